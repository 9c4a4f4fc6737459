"""A queued message's `Reception` and its report: the "queued" log line and the accepted counter;
and the report of the recipients a retried submission named again (store/duplicates.py).

The SMTP handler and the HTTP API build the Reception once the commit has succeeded and, before
they answer, `announce` writes the delivery log's reception records beside this report.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime

from pigeon_mta import model
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.metrics import DUPLICATE_RECIPIENTS, MESSAGES_ACCEPTED
from pigeon_mta.store.duplicates import Duplicates

log = logging.getLogger("pigeon_mta.submission")


@dataclass(frozen=True)
class Reception:
    """Everything known about a message when its commit has succeeded, before the 250 goes out."""

    queue_id: uuid.UUID
    org_id: uuid.UUID
    listener: str
    client_ip: str
    helo: str | None
    auth_user: str | None
    sender: str  # "" is the null sender
    recipients: tuple[str, ...]
    size: int
    header_message_id: str | None  # the Message-ID header value, without angle brackets
    tls: str | None  # "TLSv1.3 TLS_AES_256_GCM_SHA384", None without TLS
    received_at: datetime
    # MAIL's AUTH= (RFC 4954 section 5), as the client claimed it: "" for AUTH=<>, None if absent.
    auth_param: str | None = None
    lane: str = "transactional"  # the lane it is delivered in (submission/lanes.py)


def record_reception(reception: Reception) -> None:
    MESSAGES_ACCEPTED.labels(listener=reception.listener).inc()
    auth_param = "" if reception.auth_param is None else f" auth=<{reception.auth_param}>"
    log.info(
        "queued %s listener=%s client=[%s] user=%s from=<%s> nrcpt=%d size=%d message-id=<%s> "
        "lane=%s%s",
        reception.queue_id,
        reception.listener,
        reception.client_ip,
        reception.auth_user or "-",
        reception.sender,
        len(reception.recipients),
        reception.size,
        reception.header_message_id or "",
        reception.lane,
        auth_param,
    )


def record_duplicates(reception: Reception, duplicates: Duplicates) -> None:
    """Recipients not queued again: queued under the same Message-ID within the window."""
    DUPLICATE_RECIPIENTS.labels(listener=reception.listener).inc(len(duplicates.originals))
    log.info(
        "duplicate: %d of %d recipient(s) of message-id=<%s> listener=%s client=[%s] user=%s "
        "from=<%s> were queued already as %s within limits.duplicate_window, not queued again",
        len(duplicates.originals),
        len(reception.recipients),
        reception.header_message_id or "",
        reception.listener,
        reception.client_ip,
        reception.auth_user or "-",
        reception.sender,
        ", ".join(str(q) for q in sorted(set(duplicates.originals.values()))),
    )


def announce(
    message: model.Envelope,
    reception: Reception,
    duplicates: Duplicates | None,
    *,
    delivery_log: DeliveryLog | None,
) -> uuid.UUID:
    """After the commit (the group commit has handed the message to an engine or woken the
    engines): write the Reception (and Duplicate) records and the log lines. Returns the queue id
    to answer: the message's, or that of the message queued first when every recipient was a
    duplicate."""
    if duplicates is not None:
        if delivery_log is not None:
            delivery_log.duplicates(message, duplicates)
        record_duplicates(reception, duplicates)
        queued = tuple(r for r in message.recipients if r not in duplicates.originals)
        if not queued:
            return duplicates.reply_id
        message = dataclasses.replace(message, recipients=queued)
        reception = dataclasses.replace(reception, recipients=queued)
    if delivery_log is not None:
        delivery_log.reception(reception.queue_id, message)
    record_reception(reception)
    return reception.queue_id
