"""Queueing DSNs in the same transaction as the state change that calls for them.

A recipient that becomes `bounced` or `expired` and the DSN that tells its sender commit together:
a crash can lose neither alone. The DSN is an ordinary queued message (null sender, org of the
original), so it is delivered, retried and logged like any other mail.
"""

from __future__ import annotations

import contextlib
import typing
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import asyncpg

from pigeon_mta.bounce import (
    EXPIRED_STATUS,
    MAX_ORIGINAL_HEADER_BYTES,
    OriginalMessage,
    RecipientReport,
    build_bounce,
    build_delay_warning,
    header_section,
)
from pigeon_mta.ids import new_id
from pigeon_mta.model import AttemptResult, Envelope, Outcome, Reply, Status
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store import suppression as store_suppression
from pigeon_mta.store.queue import Executor, ExpiredRecipient

# Outcomes that end a recipient's delivery in failure and so are reported to the sender.
FAILED_OUTCOMES = frozenset({Outcome.BOUNCED, Outcome.EXPIRED})


def messages_needing_bounces(
    results: Sequence[AttemptResult], applied: set[uuid.UUID]
) -> dict[uuid.UUID, list[uuid.UUID]]:
    """Failed recipients of one recorded round, grouped per message: one DSN per key.

    Only results whose outcome was applied count: a stale claim's bounce is logged but reports
    nothing, since the claim that replaced it owns the recipient now.
    """
    grouped: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
    for result in results:
        if result.outcome in FAILED_OUTCOMES and result.recipient_id in applied:
            grouped[result.message_id].append(result.recipient_id)
    return dict(grouped)


# Everything a DSN needs about the recipients it reports: the last reply, the host that gave
# it (the latest attempt that reached one), and the original's sender, dates and header section
# (a prefix of the body: bodies are stored uncompressed, so only that prefix is read).
_REPORTED_RECIPIENTS = """
SELECT r.id, r.message_id, r.address, r.status, r.created_at, r.last_code, r.last_enhanced_code,
       r.last_response, m.org_id, m.sender, m.header_message_id, m.received_at,
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


async def enqueue_bounces(
    db: Executor, recipient_ids: Sequence[uuid.UUID], *, hostname: str
) -> list[uuid.UUID]:
    """Queue one DSN per message for these bounced/expired recipients; returns the DSNs' queue ids.

    Recipients of null-sender mail (DSNs themselves) are skipped: a bounce is never bounced.
    Call it in the transaction that made the recipients final.
    """
    if not recipient_ids:
        return []
    rows = await db.fetch(_REPORTED_RECIPIENTS, list(recipient_ids), MAX_ORIGINAL_HEADER_BYTES + 4)
    failed = [row for row in rows if row["status"] in (Status.BOUNCED, Status.EXPIRED)]
    dsns: list[tuple[uuid.UUID, Envelope]] = []
    for original, message_rows in _originals(failed):
        envelope = build_bounce(original, [_report(row) for row in message_rows], hostname=hostname)
        if envelope is not None:
            dsns.append((new_id(), envelope))
    # All of this round's DSNs in one statement, with one NOTIFY sent at commit.
    await store_queue.enqueue_many(db, dsns, notify=True)
    return [queue_id for queue_id, _envelope in dsns]


def _originals(
    rows: Sequence[asyncpg.Record],
) -> list[tuple[OriginalMessage, list[asyncpg.Record]]]:
    """Rows of _REPORTED_RECIPIENTS (ordered by message) grouped per original message."""
    per_message: dict[uuid.UUID, list[asyncpg.Record]] = defaultdict(list)
    for row in rows:
        per_message[row["message_id"]].append(row)
    grouped = []
    for message_rows in per_message.values():
        first = message_rows[0]
        original = OriginalMessage(
            queue_id=first["message_id"],
            org_id=first["org_id"],
            sender=first["sender"],
            received_at=first["received_at"],
            header_message_id=first["header_message_id"],
            headers=header_section(bytes(first["head"])),
        )
        grouped.append((original, message_rows))
    return grouped


def _report(row: asyncpg.Record) -> RecipientReport:
    reply = None
    if row["last_code"] or row["last_response"]:
        reply = Reply(row["last_code"] or 0, row["last_enhanced_code"], row["last_response"] or "")
    return RecipientReport(
        address=row["address"],
        reply=reply,
        remote_mta=row["mx_host"],
        status=EXPIRED_STATUS if row["status"] == Status.EXPIRED else None,
        last_attempt_at=row["started_at"],
    )


# ---------------------------------------------------------------- the engine's record step


@dataclass(frozen=True)
class Recorded:
    """What one record call did."""

    applied: set[uuid.UUID]  # recipient ids whose state moved (see queue.record_attempts)
    bounces: list[uuid.UUID] = field(default_factory=list)  # queue ids of the DSNs queued
    suppressed: int = 0  # suppression entries written for hard bounces


async def bounce_and_suppress(
    db: Executor,
    results: Sequence[AttemptResult],
    applied: set[uuid.UUID],
    *,
    hostname: str,
    suppress_for: float = 0,
) -> Recorded:
    """After record_attempts, in its transaction: DSNs for failures, suppression for hard bounces."""
    failed = messages_needing_bounces(results, applied)
    bounces = await enqueue_bounces(
        db, [rid for ids in failed.values() for rid in ids], hostname=hostname
    )
    suppressed = await store_suppression.suppress_from_bounces(
        db, results, applied, suppress_for=suppress_for
    )
    return Recorded(applied=applied, bounces=bounces, suppressed=suppressed)


async def record_attempts_and_bounce(
    db: Executor,
    results: Sequence[AttemptResult],
    *,
    hostname: str,
    suppress_for: float = 0,
) -> Recorded:
    """The engine's record step: outcomes, attempt log, DSNs and suppressions in one transaction."""
    if not results:
        return Recorded(applied=set())
    if not any(r.outcome in FAILED_OUTCOMES for r in results):
        # Nothing to bounce or suppress: the record statement is the whole transaction (one round
        # trip instead of BEGIN, record, COMMIT; most batches under load are like this).
        return Recorded(applied=await store_queue.record_attempts(db, results))
    async with _transaction(db) as conn:
        applied = await store_queue.record_attempts(conn, results)
        return await bounce_and_suppress(
            conn, results, applied, hostname=hostname, suppress_for=suppress_for
        )


# ---------------------------------------------------------------- expiry


@dataclass(frozen=True)
class Expired:
    recipients: list[ExpiredRecipient]
    bounces: list[uuid.UUID]  # queue ids of the DSNs queued


async def expire_and_bounce(
    db: Executor,
    *,
    max_age: float,
    max_age_text: str,
    hostname: str,
    limit: int = 1000,
) -> Expired:
    """Expire due recipients older than max_age and queue their DSNs (Status 4.4.7), atomically."""
    async with _transaction(db) as conn:
        expired = await store_queue.expire_old_recipients(
            conn, max_age=max_age, max_age_text=max_age_text, limit=limit
        )
        bounces = await enqueue_bounces(conn, [e.recipient_id for e in expired], hostname=hostname)
    return Expired(recipients=expired, bounces=bounces)


# ---------------------------------------------------------------- delay warnings

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


@dataclass(frozen=True)
class Warned:
    recipients: int  # recipients marked as warned (those of null-sender mail get no warning)
    warnings: list[uuid.UUID]  # queue ids of the DSNs (Action: delayed) queued


async def warn_delayed(
    db: Executor,
    *,
    after: float,
    max_age: float,
    hostname: str,
    limit: int = 1000,
) -> Warned:
    """Tell the senders of recipients still being retried `after` seconds after they were queued
    (one DSN with Action: delayed per message and round, RFC 3464), once per recipient: the mark
    and the DSNs commit together. A recipient being delivered when its message's others are
    warned is warned at a later round if it is deferred again, in a DSN of its own. The DSN says
    until when delivery will be tried: the earliest expiry (created_at + max_age) among those it
    names, so that it promises no try that will not happen."""
    async with _transaction(db) as conn:
        marked = [r["id"] for r in await conn.fetch(_MARK_DELAYED, float(after), limit)]
        if not marked:
            return Warned(recipients=0, warnings=[])
        rows = await conn.fetch(_REPORTED_RECIPIENTS, marked, MAX_ORIGINAL_HEADER_BYTES + 4)
        dsns: list[tuple[uuid.UUID, Envelope]] = []
        for original, message_rows in _originals(rows):
            envelope = build_delay_warning(
                original,
                [_report(row) for row in message_rows],
                hostname=hostname,
                retry_until=min(row["created_at"] for row in message_rows)
                + timedelta(seconds=max_age),
            )
            if envelope is not None:
                dsns.append((new_id(), envelope))
        await store_queue.enqueue_many(conn, dsns, notify=True)
    return Warned(recipients=len(marked), warnings=[queue_id for queue_id, _e in dsns])


@contextlib.asynccontextmanager
async def _transaction(db: Executor) -> AsyncIterator[asyncpg.Connection]:
    """A transaction on a pooled connection, or on (or nested in) the connection given."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn, conn.transaction():
            # The pool hands out a proxy that behaves as the connection it wraps.
            yield typing.cast(asyncpg.Connection, conn)
    else:
        async with db.transaction():
            yield db
