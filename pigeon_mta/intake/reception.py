"""A queued message's `Reception` and its report: the "queued" log line and the accepted counter;
and the report of the recipients a retried submission named again (store/duplicates.py).

The intake (accept.py) builds the Reception before the commit and, once it has succeeded and
before the door answers, `announce` writes the delivery log's reception records beside this
report.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass

from pigeon_mta import model
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.metrics import DUPLICATE_RECIPIENTS, MESSAGES_ACCEPTED
from pigeon_mta.store.duplicates import Duplicates

log = logging.getLogger("pigeon_mta.submission")


@dataclass(frozen=True)
class Reception:
    """A message ready for its commit, or committed: its queue id and its envelope."""

    queue_id: uuid.UUID
    envelope: model.Envelope
    # MAIL's AUTH= (RFC 4954 section 5), as the client claimed it: "" for AUTH=<>, None if absent.
    auth_param: str | None = None


def record_reception(reception: Reception) -> None:
    envelope = reception.envelope
    MESSAGES_ACCEPTED.labels(listener=envelope.listener).inc()
    auth_param = "" if reception.auth_param is None else f" auth=<{reception.auth_param}>"
    log.info(
        "queued %s listener=%s client=[%s] user=%s from=<%s> nrcpt=%d size=%d message-id=<%s> "
        "lane=%s%s",
        reception.queue_id,
        envelope.listener,
        envelope.client_ip or "unknown",
        envelope.auth_user or "-",
        envelope.sender,
        len(envelope.recipients),
        len(envelope.body),
        envelope.header_message_id or "",
        envelope.lane,
        auth_param,
    )


def record_duplicates(reception: Reception, duplicates: Duplicates) -> None:
    """Recipients not queued again: queued under the same Message-ID within the window."""
    envelope = reception.envelope
    DUPLICATE_RECIPIENTS.labels(listener=envelope.listener).inc(len(duplicates.originals))
    log.info(
        "duplicate: %d of %d recipient(s) of message-id=<%s> listener=%s client=[%s] user=%s "
        "from=<%s> were queued already as %s within limits.duplicate_window, not queued again",
        len(duplicates.originals),
        len(envelope.recipients),
        envelope.header_message_id or "",
        envelope.listener,
        envelope.client_ip or "unknown",
        envelope.auth_user or "-",
        envelope.sender,
        ", ".join(str(q) for q in sorted(set(duplicates.originals.values()))),
    )


def announce(
    reception: Reception, duplicates: Duplicates | None, *, delivery_log: DeliveryLog | None
) -> uuid.UUID:
    """After the commit (the group commit has handed the message to an engine or woken the
    engines): write the Reception (and Duplicate) records and the log lines. Returns the queue id
    to answer: the message's, or that of the message queued first when every recipient was a
    duplicate."""
    message = reception.envelope
    if duplicates is not None:
        if delivery_log is not None:
            delivery_log.duplicates(message, duplicates)
        record_duplicates(reception, duplicates)
        queued = tuple(r for r in message.recipients if r not in duplicates.originals)
        if not queued:
            return duplicates.reply_id
        message = dataclasses.replace(message, recipients=queued)
        reception = dataclasses.replace(reception, envelope=message)
    if delivery_log is not None:
        delivery_log.reception(reception.queue_id, message)
    record_reception(reception)
    return reception.queue_id
