"""Webhooks and their outbox: the endpoints an org registers, the events waiting to be sent to them,
and the sender's claims of those events.

Event rows are written by the statements that record outcomes (store/outcomes.py, store/upkeep.py),
each through `outbox_insert` with `event_payload` as the body; this module owns everything else
about them. A claim takes due
events FOR UPDATE SKIP LOCKED and moves each one lease ahead: an event whose sender died is due
again when the lease has passed, so every event is sent at least once. The claim increments
`attempts`, which fences the outcome as recipient.attempts does (store/leases.py). The record of
outcomes writes the new events within its caller's `Offer` as claimed already (attempts 1, one
lease ahead), so that its process's sender needs no claim for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id
from pigeon_mta.model import DSN_LISTENER
from pigeon_mta.store.executor import Executor

# The event types an endpoint may ask for; `webhook add` subscribes to all of them by default.
# The first five are recipient outcomes, written by the statements that record them; `bounced`
# (with "async": true) and `complained` are written by the record of feedback too
# (store/feedback.py: a DSN after delivery, a complaint report). `paused` and `resumed` are the
# org's own (ORG_EVENT): its mail stopped or started again, by its reputation or an operator.
RECIPIENT_EVENT_TYPES = ("delivered", "deferred", "bounced", "expired", "suppressed", "complained")
ORG_EVENT_TYPES = ("paused", "resumed")
EVENT_TYPES = RECIPIENT_EVENT_TYPES + ORG_EVENT_TYPES


def _time(expression: str) -> str:
    """A timestamptz as events write times: UTC, milliseconds, a Z."""
    return f"""to_char({expression} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')"""


# An event's timestamp: the recording transaction's time.
TIMESTAMP = _time("now()")

PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"


def event_payload(
    *,
    type_: str,
    queue_id: str,
    recipient_id: str,
    recipient: str,
    code: str,
    enhanced_code: str,
    response: str,
    category: str,
    attempt: str,
    next_attempt_at: str = "NULL::timestamptz",
    extra: Mapping[str, str] | None = None,
) -> str:
    """The SQL expression of an event's body, {"type", "timestamp", "data"}, from the column
    expressions of the statement that writes it; `extra` adds fields to data (name: SQL). The
    timestamp is TIMESTAMP. What the event says of its message (the Message-ID, the envelope
    sender, the lane, the kind and the send intent's metadata) comes from MESSAGE, the message
    row `outbox_insert(message=...)` joins for the rows that have a webhook."""
    more = "".join(f", '{name}', {value}" for name, value in (extra or {}).items())
    m = MESSAGE
    return f"""jsonb_build_object(
        'type', {type_},
        'timestamp', {TIMESTAMP},
        'data', jsonb_build_object(
            'queue_id', {queue_id}, 'recipient_id', {recipient_id}, 'recipient', {recipient},
            'message_id', {m}.header_message_id, 'sender', {m}.sender, 'lane', {m}.lane,
            'kind', CASE WHEN {m}.listener = '{DSN_LISTENER}' THEN 'dsn' ELSE 'message' END,
            'metadata', COALESCE({m}.metadata, '{{}}'::jsonb),
            'code', {code}, 'enhanced_code', {enhanced_code},
            'response', {response}, 'category', {category}, 'attempt', {attempt},
            'next_attempt_at', {_time(next_attempt_at)}{more}))"""


# The alias of the message row an event's payload reads (outbox_insert joins it).
MESSAGE = "pm"


@dataclass(frozen=True)
class OfferParameters:
    """Where a statement that writes events holds its caller's `Offer`: the SQL placeholders of
    its webhook ids (uuid[]) and their rooms (int[]), the room of every other webhook, and the
    lease of the events it writes claimed."""

    webhooks: str
    rooms: str
    other: str
    lease: str


def outbox_insert(
    *,
    rows: str,
    type_: str,
    org_id: str,
    payload: str,
    where: str | None = None,
    offer: OfferParameters | None = None,
    message: str | None = None,
) -> str:
    """The statement (a CTE's body) that writes to the outbox one event for each of `rows` (a FROM
    item, joins allowed) and each webhook of `org_id`'s org that takes the event's `type_`, with
    `payload` (event_payload) as its body: the one place events are written.

    Without `offer` every event waits for a sender's claim. With it, the first events of each
    webhook, up to its room, are written claimed by the offering sender (attempts 1, due again
    after the lease); the statement returns every event it wrote (those with attempts 0 wait)."""
    webhooks = f"JOIN webhook h ON h.org_id = {org_id} AND {type_} = ANY (h.events)"
    if message is not None:
        # The message row of event_payload (MESSAGE), read only for rows that have a webhook.
        webhooks += f"\n    JOIN message {MESSAGE} ON {MESSAGE}.id = {message}"
    condition = f"\n    WHERE {where}" if where else ""
    if offer is None:
        return f"""INSERT INTO webhook_event (id, webhook_id, type, payload)
    SELECT pigeon_uuid7(), h.id, {type_}, {payload}
    FROM {rows}
    {webhooks}{condition}"""
    return f"""INSERT INTO webhook_event (id, webhook_id, type, payload, attempts, next_attempt_at)
    SELECT pigeon_uuid7(), n.webhook_id, n.type, n.payload, (n.rank <= n.room)::int,
           now() + CASE WHEN n.rank <= n.room THEN make_interval(secs => {offer.lease})
                        ELSE '0s' END
    FROM (
        SELECT h.id AS webhook_id, {type_} AS type, {payload} AS payload,
               row_number() OVER (PARTITION BY h.id) AS rank,
               COALESCE(o.room, {offer.other}) AS room
        FROM {rows}
        {webhooks}
        LEFT JOIN unnest({offer.webhooks}::uuid[], {offer.rooms}::int[]) AS o (id, room)
               ON o.id = h.id{condition}
    ) n
    RETURNING id, webhook_id, payload, attempts, created_at"""


def org_event(condition: str = "") -> str:
    """The statement (or CTE body) that writes an event of the org $1 itself, of type $2, its
    data {"org": name} and the object $3 (jsonb): `paused` with the reason, `resumed`;
    `condition` (SQL, "AND ...") may make it write nothing."""
    return outbox_insert(
        rows="org o",
        type_="$2::text",
        org_id="o.id",
        payload=f"""jsonb_build_object('type', $2::text, 'timestamp', {TIMESTAMP},
        'data', jsonb_build_object('org', o.name) || $3::jsonb)""",
        where=f"o.id = $1::uuid {condition}",
    )


# ---------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Webhook:
    id: uuid.UUID
    org_id: uuid.UUID
    url: str
    events: tuple[str, ...]
    secret: str
    created_at: datetime
    last_status: int | None
    last_attempt_at: datetime | None
    last_error: str | None


_COLUMNS = "id, org_id, url, events, secret, created_at, last_status, last_attempt_at, last_error"


def _webhook(row: asyncpg.Record) -> Webhook:
    return Webhook(
        id=row["id"],
        org_id=row["org_id"],
        url=row["url"],
        events=tuple(row["events"]),
        secret=row["secret"],
        created_at=row["created_at"],
        last_status=row["last_status"],
        last_attempt_at=row["last_attempt_at"],
        last_error=row["last_error"],
    )


async def add_webhook(
    db: Executor, org_id: uuid.UUID, url: str, events: Sequence[str], secret: str
) -> Webhook:
    row = await db.fetchrow(
        f"INSERT INTO webhook (id, org_id, url, events, secret) VALUES ($1, $2, $3, $4, $5) "
        f"RETURNING {_COLUMNS}",
        new_id(),
        org_id,
        url,
        list(events),
        secret,
    )
    assert row is not None
    return _webhook(row)


async def find_webhook(db: Executor, webhook_id: uuid.UUID) -> Webhook | None:
    row = await db.fetchrow(f"SELECT {_COLUMNS} FROM webhook WHERE id = $1", webhook_id)
    return None if row is None else _webhook(row)


@dataclass(frozen=True)
class WebhookSummary:
    webhook: Webhook
    backlog: int  # events waiting to be sent
    failed: int  # events given up after webhooks.max_age


# Counted through webhook_event_due (pending) and by webhook for the failed ones: both follow what
# is waiting or given up, not the history of delivered events.
_LIST = f"""
SELECT {", ".join("w." + c.strip() for c in _COLUMNS.split(","))},
       (SELECT count(*) FROM webhook_event e
        WHERE e.webhook_id = w.id AND e.state = 'pending') AS backlog,
       (SELECT count(*) FROM webhook_event e
        WHERE e.webhook_id = w.id AND e.state = 'failed') AS failed
FROM webhook w
WHERE $1::uuid IS NULL OR w.org_id = $1
ORDER BY w.created_at, w.id
"""


async def list_webhooks(db: Executor, org_id: uuid.UUID | None = None) -> list[WebhookSummary]:
    return [
        WebhookSummary(_webhook(row), row["backlog"], row["failed"])
        for row in await db.fetch(_LIST, org_id)
    ]


async def remove_webhook(db: asyncpg.Connection, webhook_id: uuid.UUID) -> bool:
    """Delete a webhook and its events (sent or not) in one transaction; False if there is none."""
    async with db.transaction():
        await db.execute("DELETE FROM webhook_event WHERE webhook_id = $1", webhook_id)
        tag = await db.execute("DELETE FROM webhook WHERE id = $1", webhook_id)
    return tag != "DELETE 0"


async def note_reply(
    db: Executor, webhook_id: uuid.UUID, status: int | None, error: str | None
) -> None:
    """Remember the last request's reply on the webhook (`webhook list` shows it)."""
    await db.execute(
        "UPDATE webhook SET last_status = $2, last_error = $3, last_attempt_at = now() "
        "WHERE id = $1",
        webhook_id,
        status,
        error,
    )


# ---------------------------------------------------------------- the sender's claims


@dataclass(frozen=True)
class ClaimedEvent:
    id: uuid.UUID
    webhook_id: uuid.UUID
    url: str
    secret: str
    body: bytes  # the payload as stored: the request body, signed as it is sent
    attempts: int  # this claim's number (fencing token)
    created_at: datetime


@dataclass(frozen=True)
class Offer:
    """The room a sender offers the statement that records outcomes (store/outcomes.py): the new
    events of a webhook with room are written already claimed by that sender (attempts 1, due again
    after `lease` seconds) and returned to it, so that it sends them with no claim of its own; the
    others wait in the outbox for a claim."""

    rooms: Mapping[uuid.UUID, int]  # webhooks the sender has requests in flight to: their room
    other: int  # the room of every other webhook
    lease: float


# No room: every new event waits in the outbox.
NO_OFFER = Offer({}, 0, 0.0)


# Cross-tenant by design, like the recipient claim: one sender serves every org's webhooks. Each
# webhook gets up to its room ($1, less what this sender has in flight to it: $2/$3), oldest due
# first, through webhook_event_due; a webhook with no room is not read at all, so a stalled
# endpoint's backlog costs nothing here.
_CLAIM = """
WITH room AS (
    SELECT h.id, h.url, h.secret, $1::int - COALESCE(b.busy, 0) AS room
    FROM webhook h LEFT JOIN unnest($2::uuid[], $3::int[]) AS b (id, busy) ON b.id = h.id
), picked AS (
    SELECT e.id, r.url, r.secret FROM room r
    CROSS JOIN LATERAL (
        SELECT id FROM webhook_event
        WHERE webhook_id = r.id AND state = 'pending' AND next_attempt_at <= now()
        ORDER BY next_attempt_at LIMIT r.room
        FOR UPDATE SKIP LOCKED) e
    WHERE r.room > 0
)
UPDATE webhook_event e
SET next_attempt_at = now() + make_interval(secs => $4), attempts = e.attempts + 1,
    updated_at = now()
FROM picked p WHERE e.id = p.id
RETURNING e.id, e.webhook_id, p.url, p.secret, e.payload::text AS body, e.attempts, e.created_at
"""


def claimed_event(row: asyncpg.Record) -> ClaimedEvent:
    """A claimed event from the row a claim (or the record's handoff) returns."""
    return ClaimedEvent(
        id=row["id"],
        webhook_id=row["webhook_id"],
        url=row["url"],
        secret=row["secret"],
        body=row["body"].encode(),
        attempts=row["attempts"],
        created_at=row["created_at"],
    )


async def claim_due_events(
    db: Executor, *, room: int, busy: Mapping[uuid.UUID, int], lease: float
) -> list[ClaimedEvent]:
    """Claim due events, at most `room` per webhook less what `busy` says is in flight to it; each
    is due again after `lease` seconds unless its outcome is recorded first."""
    return [
        claimed_event(row)
        for row in await db.fetch(_CLAIM, room, list(busy), list(busy.values()), float(lease))
    ]


@dataclass(frozen=True)
class EventResult:
    """What one request did for one claimed event."""

    event: ClaimedEvent
    state: str  # delivered, pending (tried again at next_attempt_at) or failed
    status: int | None  # the HTTP status (None: no reply)
    error: str | None  # why it was not accepted (None after a 2xx)
    next_attempt_at: datetime | None = None  # only for pending


# One statement for a batch: the events move (only for the claim that made each request), and each
# webhook remembers a reply of the batch.
_RECORD = """
WITH v AS (
    SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[], $4::int[], $5::text[],
                         $6::timestamptz[], $7::uuid[])
        AS v (id, attempts, state, status, error, next_attempt_at, webhook_id)
), e AS (
    UPDATE webhook_event e
    SET state = v.state, last_status = v.status, last_error = v.error,
        next_attempt_at = COALESCE(v.next_attempt_at, e.next_attempt_at), updated_at = now()
    FROM v WHERE e.id = v.id AND e.attempts = v.attempts AND e.state = 'pending'
)
UPDATE webhook h
SET last_status = l.status, last_error = l.error, last_attempt_at = now()
FROM (SELECT DISTINCT ON (webhook_id) webhook_id, status, error FROM v
      ORDER BY webhook_id) l
WHERE h.id = l.webhook_id
"""


async def record_event_results(db: Executor, results: Sequence[EventResult]) -> None:
    if not results:
        return
    await db.execute(
        _RECORD,
        [r.event.id for r in results],
        [r.event.attempts for r in results],
        [r.state for r in results],
        [r.status for r in results],
        [r.error for r in results],
        [r.next_attempt_at for r in results],
        [r.event.webhook_id for r in results],
    )


# Claims the sender gives back unsent (it is stopping): due again at once, the request not counted.
_RELEASE = """
UPDATE webhook_event e
SET next_attempt_at = now(), attempts = e.attempts - 1, updated_at = now()
FROM unnest($1::uuid[], $2::int[]) AS v (id, attempts)
WHERE e.id = v.id AND e.attempts = v.attempts AND e.state = 'pending'
"""


async def release_events(db: Executor, events: Sequence[ClaimedEvent]) -> None:
    if events:
        await db.execute(_RELEASE, [e.id for e in events], [e.attempts for e in events])


async def backlog(db: Executor) -> int:
    """Events waiting to be sent, to every webhook (the pigeon_webhook_backlog gauge)."""
    return int(await db.fetchval("SELECT count(*) FROM webhook_event WHERE state = 'pending'"))


# Finished events (delivered or failed) go after retention.messages, like the mail they report on.
_PRUNE = """
DELETE FROM webhook_event WHERE id IN (
    SELECT id FROM webhook_event
    WHERE state <> 'pending' AND created_at < now() - make_interval(secs => $1)
    LIMIT $2)
"""


async def prune_finished_events(db: Executor, *, older_than: float, limit: int = 1000) -> int:
    tag = await db.execute(_PRUNE, float(older_than), limit)
    return int(tag.rsplit(" ", 1)[-1])
