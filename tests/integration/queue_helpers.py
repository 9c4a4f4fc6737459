"""Helpers that put many rows into a real queue quickly (test data, made in SQL)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import asyncpg

from pigeon_mta.model import AttemptResult, Delivery, Envelope, Outcome, Reply
from pigeon_mta.outbound.claims import group_deliveries
from pigeon_mta.store import claims, outcomes, queue
from pigeon_mta.store.executor import Executor

# The built-in lanes' weights (config.default_lanes), as the engine passes them to the claim.
LANE_WEIGHTS = {"transactional": 10.0, "bulk": 1.0}


async def claim(
    db: asyncpg.Pool | asyncpg.Connection, *, owner: str, lease: float, batch: int
) -> list[Delivery]:
    """Claim due recipients, grouped into one Delivery per (message, domain) as the engine
    groups them when no static route joins domains."""
    claimed = await claims.claim_due_recipients(
        db, owner=owner, lease=lease, batch=batch, lane_weights=LANE_WEIGHTS
    )
    return group_deliveries(claimed.rows)


async def bulk_queue(
    db: asyncpg.Pool | asyncpg.Connection,
    org_id: uuid.UUID,
    *,
    messages: int,
    recipients_per_message: int = 1,
    status: str = "queued",
    due_in: float = 0.0,
    age: float = 0.0,
    domain: str = "example.net",
    lane: str = "transactional",
) -> None:
    """`messages` messages with `recipients_per_message` recipients each, all in one statement."""
    await db.execute(
        """
        WITH m AS (
            INSERT INTO message (id, org_id, sender, size, body, listener, received_at, lane)
            SELECT gen_random_uuid(), $1, 'sender@example.com', 20, 'Subject: t\r\n\r\nbody\r\n',
                   'test', now() - make_interval(secs => $5), $8
            FROM generate_series(1, $2)
            RETURNING id, received_at
        )
        INSERT INTO recipient (id, message_id, org_id, address, domain, status, created_at,
                               next_attempt_at, lease_until, lease_owner, lane)
        SELECT gen_random_uuid(), m.id, $1, 'rcpt' || n || '.' || left(m.id::text, 8) || '@' || $6,
               $6, $3, m.received_at, now() + make_interval(secs => $4),
               -- a row in flight holds a lease, as a claim leaves it
               CASE WHEN $3 = 'delivering' THEN now() + interval '5 minutes' END,
               CASE WHEN $3 = 'delivering' THEN 'bulk-test' END, $8
        FROM m, generate_series(1, $7) AS n
        """,
        org_id,
        messages,
        status,
        due_in,
        age,
        domain,
        recipients_per_message,
        lane,
    )


def results_for(
    deliveries: list[Delivery], outcome: Outcome, *, retry_in: float = 60, code: int = 250
) -> list[AttemptResult]:
    now = datetime.now(UTC)
    return [
        AttemptResult(
            recipient_id=r.id,
            queue_id=d.queue_id,
            org_id=d.org_id,
            attempt=r.attempts,
            outcome=outcome,
            reply=Reply(code, f"{code // 100}.0.0", "test reply"),
            started_at=now,
            duration=0.01,
            next_attempt_at=now + timedelta(seconds=retry_in)
            if outcome == Outcome.DEFERRED
            else None,
            mx_host="mx.example.net",
            ip="127.0.0.1",
            port=25,
        )
        for d in deliveries
        for r in d.recipients
    ]


async def suppressed_at_claim(
    pool: asyncpg.Pool, org_id: uuid.UUID, addresses: list[str]
) -> set[str]:
    """Which of `addresses` the engine would not mail: a message to them queued and claimed, as
    the engine claims (the claim reads each recipient's suppression entry). Use on an otherwise
    empty queue."""
    await queue.enqueue(
        pool,
        Envelope(
            org_id=org_id,
            sender="alice@example.com",
            recipients=tuple(addresses),
            body=b"Subject: t\r\n\r\nbody\r\n",
            listener="relay",
        ),
    )
    claimed = await claim(pool, owner="test", lease=60, batch=1000)
    return {r.address for d in claimed for r in d.recipients if r.suppressed is not None}


async def record_attempts(db: Executor, results: Sequence[AttemptResult]) -> set[uuid.UUID]:
    """Record a batch of outcomes with no webhook sender to hand events to (as the recorder does,
    outbound/recorder.py); returns the recipient ids whose state moved."""
    return (await outcomes.record_outcomes(db, results)).applied
