"""The send intent on a real PostgreSQL, through the intake: its header fields are taken out and
stored, a schedule keeps the claim away until its time, an ordering key lets the claim take a
recipient only after the one before it is final, and the sweeper expires mail whose deadline
passed while nothing claimed it (its org suspended), with its DSN.

Intake (group commit) --> message, recipient --> claim (store/claims.py) / expire_and_bounce
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.dsn_queue import expire_and_bounce
from pigeon_mta.intake.accept import Intake, Queued
from pigeon_mta.intake.intent import Intent
from pigeon_mta.intake.refusal import Reason, Refusal
from pigeon_mta.intake.submission import Door, Submission, Submitter
from pigeon_mta.model import DEADLINE_CATEGORY, Outcome
from pigeon_mta.outbound.outcome import split_past_deadline
from pigeon_mta.store import suspensions
from pigeon_mta.store.orgs import ensure_org
from tests.integration.queue_helpers import claim, record_attempts, results_for


async def accept(
    pool: asyncpg.Pool,
    to: str,
    headers: str = "",
    intent: Intent | None = None,
    org_id: uuid.UUID | None = None,
) -> Queued | Refusal:
    data = (f"From: app@acme.example\r\nTo: {to}\r\nSubject: s\r\n{headers}\r\nbody\r\n").encode()
    return await Intake.of(Settings(), pool).accept(
        Submission(
            door=Door(listener="relay"),
            submitter=Submitter(org_id=org_id),
            sender="app@acme.example",
            recipients=(to,),
            data=data,
            intent=intent or Intent(),
        )
    )


async def test_header_fields_are_stored_and_never_queued_in_the_message(
    pool: asyncpg.Pool,
) -> None:
    queued = await accept(
        pool,
        "ann@dest.test",
        "X-Pigeon-Send-At: 3600\r\nX-Pigeon-Order-Key: acct-1\r\nX-Pigeon-Meta-Event: e1\r\n"
        "X-Pigeon-Expires: 2h\r\n",
    )
    assert isinstance(queued, Refusal) and queued.reason is Reason.BAD_INTENT
    assert (queued.intent_field, queued.intent_problem[:22]) == (
        "X-Pigeon-Expires",
        "must be an RFC 3339 ti",
    )
    assert await pool.fetchval("SELECT count(*) FROM message") == 0

    queued = await accept(
        pool,
        "ann@dest.test",
        "X-Pigeon-Send-At: 3600\r\nX-Pigeon-Order-Key: acct-1\r\nX-Pigeon-Meta-Event: e1\r\n",
    )
    assert isinstance(queued, Queued)
    row = await pool.fetchrow(
        """SELECT m.body, m.send_at, m.order_key, m.metadata::text AS metadata, r.created_at,
                  r.next_attempt_at, r.order_key AS recipient_key
           FROM message m JOIN recipient r ON r.message_id = m.id WHERE m.id = $1""",
        queued.queue_id,
    )
    assert b"X-Pigeon-" not in row["body"].replace(b"X-Pigeon-Submitted", b"")
    assert row["next_attempt_at"] == row["send_at"] == row["created_at"]
    assert row["send_at"] > datetime.now(UTC) + timedelta(minutes=59)
    assert (row["order_key"], row["recipient_key"]) == ("acct-1", "acct-1")
    assert json.loads(row["metadata"]) == {"event": "e1"}
    # Scheduled: nothing is due to claim.
    assert await claim(pool, owner="node-a", lease=60, batch=10) == []


async def test_one_key_is_claimed_in_order_and_other_mail_is_not_held(
    pool: asyncpg.Pool,
) -> None:
    queued = [
        await accept(pool, "bob@dest.test", intent=Intent(order_key=key))
        for key in ("k", "k", "other", None)
    ]
    assert all(isinstance(q, Queued) for q in queued)
    first, second, other_key, unkeyed = (q.queue_id for q in queued)  # type: ignore[union-attr]
    claimed = await claim(pool, owner="node-a", lease=60, batch=10)
    assert {d.queue_id for d in claimed} == {first, other_key, unkeyed}

    # The first deferred and due again: it is claimed again, the second still waits.
    [d1] = [d for d in claimed if d.queue_id == first]
    await record_attempts(pool, results_for([d1], Outcome.DEFERRED, retry_in=0))
    retried = await claim(pool, owner="node-a", lease=60, batch=10)
    assert [d.queue_id for d in retried] == [first]
    # Delivered: the second goes.
    await record_attempts(pool, results_for(retried, Outcome.DELIVERED))
    assert [d.queue_id for d in await claim(pool, owner="node-a", lease=60, batch=10)] == [second]
    # While the second is in flight, another org's mail of the same key and address is not held.
    other_org = await ensure_org(pool, "other")
    theirs = await accept(pool, "bob@dest.test", intent=Intent(order_key="k"), org_id=other_org)
    assert isinstance(theirs, Queued)
    claimed = await claim(pool, owner="node-a", lease=60, batch=10)
    assert [d.queue_id for d in claimed] == [theirs.queue_id]


async def test_the_sweeper_expires_unclaimed_mail_past_its_deadline_with_a_dsn(
    pool: asyncpg.Pool,
) -> None:
    queued = await accept(
        pool, "carol@dest.test", intent=Intent(expires_at=datetime.now(UTC) + timedelta(hours=1))
    )
    assert isinstance(queued, Queued)
    org = await pool.fetchval("SELECT org_id FROM message WHERE id = $1", queued.queue_id)
    async with pool.acquire() as conn:
        await suspensions.suspend(conn, suspensions.ORG + str(org), reason="audit", seconds=None)
    await pool.execute(
        "UPDATE message SET expires_at = now() - interval '1 second' WHERE id = $1",
        queued.queue_id,
    )
    expired = await expire_and_bounce(
        pool, max_age=5 * 86400, max_age_text="5d", hostname="mta.test"
    )
    assert [e.queue_id for e in expired.recipients] == [queued.queue_id]
    assert len(expired.bounces) == 1  # the sender is told, as for any expiry
    row = await pool.fetchrow(
        "SELECT outcome, category, response FROM attempt WHERE message_id = $1", queued.queue_id
    )
    assert (row["outcome"], row["category"]) == ("expired", DEADLINE_CATEGORY)
    assert row["response"].startswith("not attempted: the message's deadline ")
    # Once is enough: a second round finds nothing.
    again = await expire_and_bounce(pool, max_age=5 * 86400, max_age_text="5d", hostname="m")
    assert again.recipients == []


async def test_a_claimed_delivery_past_its_deadline_is_not_attempted(pool: asyncpg.Pool) -> None:
    queued = await accept(
        pool, "dan@dest.test", intent=Intent(expires_at=datetime.now(UTC) + timedelta(seconds=30))
    )
    assert isinstance(queued, Queued)
    [delivery] = await claim(pool, owner="node-a", lease=60, batch=10)
    assert delivery.expires_at is not None
    keep, results = split_past_deadline([delivery], now=datetime.now(UTC))
    assert (keep, results) == ([delivery], [])
    keep, results = split_past_deadline([delivery], now=delivery.expires_at + timedelta(0, 1))
    assert keep == [] and [r.outcome for r in results] == [Outcome.EXPIRED]
    assert results[0].category == DEADLINE_CATEGORY
    assert "deadline" in results[0].reply.text
    assert uuid.UUID(str(results[0].queue_id)) == queued.queue_id
