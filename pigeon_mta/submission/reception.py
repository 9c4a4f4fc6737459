"""A queued message's `Reception` and its report: the "queued" log line and the accepted counter;
and the report of the recipients a retried submission named again (store/duplicates.py).

The handler builds the Reception once the commit has succeeded and, before the 250, writes the
delivery log's reception records beside this report (`SubmissionHandler._announce`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime

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
