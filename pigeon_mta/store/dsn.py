"""What a DSN reports, read from the queue: failed or delayed recipients and their originals.

The statements here only read and mark rows; which recipients call for a DSN and what it says are
decided outside the store (pigeon_mta/dsn_queue.py), which builds the DSN and queues it in the same
transaction as the state change that called for it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.model import Reply, Status
from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class ReportedRecipient:
    """One recipient a DSN may name, with what it needs about the original message."""

    recipient_id: uuid.UUID
    queue_id: uuid.UUID
    address: str
    status: Status
    created_at: datetime
    last_reply: Reply | None  # the reply (or local failure) its last attempt recorded
    remote_mta: str | None  # the host that gave it: the latest attempt that reached one
    last_attempt_at: datetime | None
    org_id: uuid.UUID
    sender: str
    header_message_id: str | None
    received_at: datetime
    head: bytes  # the first bytes of the original, enough for its header section
    lane: str = "transactional"  # its lane, whose max_age may be its own


# Everything a DSN needs about the recipients it reports: the last reply, the host that gave
# it (the latest attempt that reached one), and the original's sender, dates and header section
# (a prefix of the body: bodies are stored uncompressed, so only that prefix is read). Null-sender
# mail (DSNs themselves) is left out: a bounce is never bounced.
_REPORTED_RECIPIENTS = """
SELECT r.id, r.message_id, r.address, r.status, r.created_at, r.last_code, r.last_enhanced_code,
       r.last_response, r.lane, m.org_id, m.sender, m.header_message_id, m.received_at,
       substring(m.body FROM 1 FOR $2) AS head, a.mx_host, a.started_at
FROM recipient r
JOIN message m ON m.id = r.message_id
LEFT JOIN LATERAL (
    SELECT mx_host, started_at FROM attempt
    WHERE recipient_id = r.id AND outcome NOT IN ('expired', 'cancelled', 'retried')
    ORDER BY started_at DESC LIMIT 1
) a ON true
WHERE r.id = ANY ($1::uuid[]) AND m.sender <> ''
ORDER BY r.message_id, r.address
"""


async def reported_recipients(
    db: Executor, recipient_ids: Sequence[uuid.UUID], *, head_bytes: int
) -> list[ReportedRecipient]:
    """These recipients (those of non-null-sender mail), ordered by message, then address; each
    with the first `head_bytes` of its original."""
    if not recipient_ids:
        return []
    rows = await db.fetch(_REPORTED_RECIPIENTS, list(recipient_ids), head_bytes)
    return [_reported(row) for row in rows]


def _reported(row: asyncpg.Record) -> ReportedRecipient:
    reply = None
    if row["last_code"] or row["last_response"]:
        reply = Reply(row["last_code"] or 0, row["last_enhanced_code"], row["last_response"] or "")
    return ReportedRecipient(
        recipient_id=row["id"],
        queue_id=row["message_id"],
        address=row["address"],
        status=Status(row["status"]),
        created_at=row["created_at"],
        last_reply=reply,
        remote_mta=row["mx_host"],
        last_attempt_at=row["started_at"],
        org_id=row["org_id"],
        sender=row["sender"],
        header_message_id=row["header_message_id"],
        received_at=row["received_at"],
        head=bytes(row["head"]),
        lane=row["lane"],
    )


# Deferred recipients (queued after an attempt) waiting longer than the warning age whose sender
# was not told yet, oldest first, marked as told; SKIP LOCKED: a row a claim holds is taken at a
# later round, and two nodes never warn about the same row. The predicate is recipient_warn_due's
# (migration 0009), which holds only such rows.
_MARK_DELAYED = """
WITH due AS (
    SELECT id FROM recipient
    WHERE status = 'queued' AND attempts > 0 AND delay_warned_at IS NULL
      AND created_at < now() - make_interval(secs => $1)
    ORDER BY created_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE recipient r SET delay_warned_at = now()
FROM due WHERE r.id = due.id
RETURNING r.id
"""


async def mark_delayed(db: Executor, *, after: float, limit: int) -> list[uuid.UUID]:
    """Mark up to `limit` recipients still retried `after` seconds after they were queued, and
    not marked before, as warned; returns their ids. Call it in the transaction that queues the
    warnings, so that the mark and the DSNs commit together."""
    return [r["id"] for r in await db.fetch(_MARK_DELAYED, float(after), limit)]
