"""Queue upkeep: expiring recipients too old to deliver, purging finished messages, queue stats."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pigeon_mta.ids import id_floor
from pigeon_mta.model import DEADLINE_CATEGORY, EXPIRED_CATEGORY
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.webhooks import backlog as webhook_backlog
from pigeon_mta.store.webhooks import event_payload, outbox_insert

# ---------------------------------------------------------------- expiry


def _expiry(pick: str, response: str, category: str) -> str:
    """The statement that expires the recipients `pick` finds (a query of their `id` and `why`,
    text for `response`, that locks them FOR UPDATE OF r SKIP LOCKED): their status, an attempt
    row and the `expired` webhook events, committed together; it returns (recipient_id,
    message_id) of each. `response` is what the attempt log and the event say (SQL over `e`)."""
    payload = event_payload(
        type_="'expired'",
        queue_id="e.message_id",
        recipient_id="e.id",
        recipient="e.address",
        code="e.last_code",
        enhanced_code="e.last_enhanced_code",
        response=response,
        category=f"'{category}'",
        attempt="e.attempts",
    )
    outbox = outbox_insert(
        rows="e", type_="'expired'", org_id="e.org_id", payload=payload, message="e.message_id"
    )
    return f"""
WITH picked AS ({pick}
), e AS (
    UPDATE recipient r
    SET status = 'expired', updated_at = now(), lease_until = NULL, lease_owner = NULL
    FROM picked WHERE r.id = picked.id
    RETURNING r.id, r.message_id, r.org_id, r.attempts, r.last_code, r.last_enhanced_code,
              r.last_response, r.address, picked.why
), w AS (
    -- The `expired` webhook events, committed with the expiry (store/webhooks.py).
    {outbox}
)
INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, outcome,
                     code, enhanced_code, response, category)
SELECT gen_random_uuid(), e.id, e.message_id, e.org_id, e.attempts, now(), 'expired',
       e.last_code, e.last_enhanced_code, {response}, '{category}'
FROM e
RETURNING recipient_id, message_id
"""


# Reads only live rows older than the shortest max_age (a range of recipient_live, by created_at),
# and of those only due ones: mail that is not due waits for its next attempt, where the engine's
# own max_age check expires it. A lane's max_age ($5, by the lane names of $4,
# with its text $6) replaces delivery.max_age ($1, $3) for the rows of that lane; $7, the
# shortest of them, bounds created_at for every row, so that rows too young for any lane are
# passed over at once.
_EXPIRE = _expiry(
    """
    SELECT r.id, COALESCE(l.max_age_text, $3) AS why
    FROM recipient r
    LEFT JOIN unnest($4::text[], $5::float8[], $6::text[]) AS l (lane, max_age, max_age_text)
           ON l.lane = r.lane
    WHERE r.status = 'queued' AND r.next_attempt_at <= now()
      AND r.created_at < now() - make_interval(secs => $7)
      AND r.created_at < now() - make_interval(secs => COALESCE(l.max_age, $1))
    LIMIT $2
    FOR UPDATE OF r SKIP LOCKED""",
    response="'expired after ' || e.why || ' in the queue; last reply: '"
    " || COALESCE(e.last_response, 'none')",
    category=EXPIRED_CATEGORY,
)

# Queued recipients of messages whose deadline (the send intent's expires_at) has passed within the
# last $1 seconds (the longest max_age: older mail has expired by its age), through the partial
# index message_deadline: mail the engines did not claim before its deadline (its org paused, its
# site suspended) expires then, not when it is next claimed. Due or not: no attempt may follow.
_EXPIRE_DEADLINE = _expiry(
    """
    SELECT r.id, to_char(m.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') AS why
    FROM message m JOIN recipient r ON r.message_id = m.id
    WHERE m.expires_at IS NOT NULL AND m.expires_at <= now()
      AND m.expires_at > now() - make_interval(secs => $1)
      AND r.status = 'queued'
    LIMIT $2
    FOR UPDATE OF r SKIP LOCKED""",
    response="'not attempted: the message''s deadline ' || e.why"
    " || ' UTC has passed; last reply: ' || COALESCE(e.last_response, 'none')",
    category=DEADLINE_CATEGORY,
)


async def expire_past_deadline(
    db: Executor, *, window: float, limit: int = 1000
) -> list[ExpiredRecipient]:
    """Queued recipients whose message's deadline passed within `window` seconds become
    `expired` (category `deadline`, with an attempt-log entry and the webhook event)."""
    rows = await db.fetch(_EXPIRE_DEADLINE, float(window), limit)
    return [ExpiredRecipient(r["recipient_id"], r["message_id"]) for r in rows]


@dataclass(frozen=True)
class ExpiredRecipient:
    recipient_id: uuid.UUID
    queue_id: uuid.UUID


@dataclass(frozen=True)
class LaneMaxAge:
    """A lane whose recipients expire after their own max_age instead of delivery.max_age."""

    lane: str
    max_age: float  # seconds
    text: str  # as the attempt log says it ("2d")


async def expire_old_recipients(
    db: Executor,
    *,
    max_age: float,
    max_age_text: str,
    lane_max_ages: Sequence[LaneMaxAge] = (),
    limit: int = 1000,
) -> list[ExpiredRecipient]:
    """Due recipients older than their lane's max age (`lane_max_ages`), else than `max_age`,
    become `expired` (with an attempt-log entry)."""
    shortest = min([max_age, *(lane.max_age for lane in lane_max_ages)])
    rows = await db.fetch(
        _EXPIRE,
        float(max_age),
        limit,
        max_age_text,
        [lane.lane for lane in lane_max_ages],
        [float(lane.max_age) for lane in lane_max_ages],
        [lane.text for lane in lane_max_ages],
        float(shortest),
    )
    return [ExpiredRecipient(r["recipient_id"], r["message_id"]) for r in rows]


# ---------------------------------------------------------------- retention

# Message ids are UUIDv7, so "received before the cutoff" is a range of the primary key, which
# the index serves; received_at decides, so that a row whose id is not time-ordered (made by hand
# or by another tool) is never purged early. Only messages none of whose recipients is still
# queued or being delivered are purged; recipients go with their message (ON DELETE CASCADE),
# attempts by their recipients' ids (every statement of a WITH sees the rows as they were).
#
# The live check runs for each old message, through recipient_message, until the batch is full.
# OFFSET 0 keeps it that way: without it PostgreSQL turns NOT EXISTS into an anti join and may
# merge it with recipient_message read from its start up to the first live row; live rows are the
# newest, so that read the whole history (1.8 s of a batch at 1M recipients, bench/admin_bench.py).
# A deleted attempt's suppression entries are found through suppression_attempt (migration 0012).
_PURGE = """
WITH old AS (
    SELECT m.id FROM message m
    WHERE m.id < $1
      AND m.received_at < now() - make_interval(secs => $3)
      AND NOT EXISTS (SELECT 1 FROM recipient r
                      WHERE r.message_id = m.id AND r.status IN ('queued', 'delivering')
                      OFFSET 0)
    ORDER BY m.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), a AS (
    DELETE FROM attempt
    WHERE recipient_id IN (SELECT r.id FROM recipient r WHERE r.message_id IN (SELECT id FROM old))
)
DELETE FROM message WHERE id IN (SELECT id FROM old)
RETURNING id
"""


async def purge_finished_messages(db: Executor, *, older_than: float, limit: int = 1000) -> int:
    """Delete up to `limit` finished messages received more than `older_than` seconds ago."""
    cutoff = id_floor(time.time() - older_than)
    return len(await db.fetch(_PURGE, cutoff, limit, float(older_than)))


# ---------------------------------------------------------------- stats


@dataclass(frozen=True)
class LaneStats:
    """The live queue of one lane."""

    lane: str
    queued: int  # waiting, due or not
    due: int  # queued and due now
    deferred: int  # queued after at least one attempt
    delivering: int  # claimed, under a lease
    oldest_due_age: float  # seconds the longest-waiting due recipient has waited (0 if none)
    scheduled: int = 0  # queued, never tried, not due yet: a send intent's send_at


@dataclass(frozen=True)
class QueueStats:
    queued: int  # waiting, due or not
    due: int  # queued and due now
    deferred: int  # queued after at least one attempt
    delivering: int  # claimed, under a lease
    oldest_due_age: float  # seconds the longest-waiting due recipient has waited (0 if none)
    lanes: tuple[LaneStats, ...] = ()  # the lanes that have live rows, by name
    webhook_backlog: int = 0  # webhook events waiting to be sent
    scheduled: int = 0  # queued, never tried, not due yet


# Only the live part of the table is read (the queued rows and the leased ones, through their
# partial indexes), so the cost follows the queue depth, not the history. One pass over the queued
# rows gives every figure of each lane; it reads each row, where counting index entries alone
# could not tell the lanes apart (about twice the time, bench/README.md "Metrics endpoint").
# lease_until is set exactly while status = 'delivering' (migration 0006).
_STATS = """
SELECT lane, sum(queued)::bigint AS queued, sum(due)::bigint AS due,
       sum(deferred)::bigint AS deferred, sum(delivering)::bigint AS delivering,
       COALESCE(extract(epoch FROM now() - min(oldest_due)), 0) AS oldest_due_age,
       sum(scheduled)::bigint AS scheduled
FROM (
    SELECT lane, count(*) AS queued,
           count(*) FILTER (WHERE next_attempt_at <= now()) AS due,
           count(*) FILTER (WHERE attempts > 0) AS deferred,
           0 AS delivering,
           min(next_attempt_at) FILTER (WHERE next_attempt_at <= now()) AS oldest_due,
           count(*) FILTER (WHERE attempts = 0 AND next_attempt_at > now()) AS scheduled
    FROM recipient WHERE status = 'queued' GROUP BY lane
    UNION ALL
    SELECT lane, 0, 0, 0, count(*), NULL, 0
    FROM recipient WHERE lease_until IS NOT NULL GROUP BY lane
) live
GROUP BY lane
ORDER BY lane
"""


async def queue_stats(db: Executor) -> QueueStats:
    """The live queue, in all and per lane."""
    lanes = tuple(
        LaneStats(
            lane=row["lane"],
            queued=row["queued"],
            due=row["due"],
            deferred=row["deferred"],
            delivering=row["delivering"],
            oldest_due_age=float(row["oldest_due_age"]),
            scheduled=row["scheduled"],
        )
        for row in await db.fetch(_STATS)
    )
    return QueueStats(
        queued=sum(lane.queued for lane in lanes),
        due=sum(lane.due for lane in lanes),
        deferred=sum(lane.deferred for lane in lanes),
        delivering=sum(lane.delivering for lane in lanes),
        oldest_due_age=max((lane.oldest_due_age for lane in lanes), default=0.0),
        lanes=lanes,
        webhook_backlog=await webhook_backlog(db),
        scheduled=sum(lane.scheduled for lane in lanes),
    )
