"""Feedback messages as the feedback listener accepted them, and what applying them recorded.

`keep` stores a message once by its report key (its Message-ID, else a hash of its body): a repeat
of the same report changes nothing. `take_new` claims a batch of unread ones (FOR UPDATE SKIP
LOCKED, in the caller's transaction); `record` writes, in that transaction, the events found
(`feedback_event`, once per recipient and kind), moves a delivered recipient of a hard bounce to
bounced, suppresses the address when the event says so (a manual entry stays as it is), writes
the `bounced` (with `"async": true`) and `complained` webhook events, and marks each message with
what became of it.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id, new_ids
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.suppression import SUPPRESSION_ACTIVE
from pigeon_mta.store.webhooks import event_payload, outbox_insert

NEW = "new"
APPLIED = "applied"
UNMATCHED = "unmatched"
NOT_UNDERSTOOD = "not-understood"
STATUSES = (NEW, APPLIED, UNMATCHED, NOT_UNDERSTOOD)


def report_key(message_id: str | None, body: bytes) -> str:
    """What makes two feedback messages the same report."""
    if message_id:
        return "mid:" + message_id
    return "sha256:" + hashlib.sha256(body).hexdigest()


async def keep(
    db: Executor,
    *,
    key: str,
    listener: str,
    client_ip: str | None,
    helo: str | None,
    mail_from: str,
    rcpt_to: Sequence[str],
    body: bytes,
) -> tuple[uuid.UUID, bool]:
    """Store a feedback message; (its id, whether it is new). A repeat returns the first's id."""
    row = await db.fetchrow(
        """WITH n AS (
               INSERT INTO feedback (id, report_key, listener, client_ip, helo, mail_from,
                                     rcpt_to, body)
               VALUES ($1, $2, $3, $4::inet, $5, $6, $7, $8)
               ON CONFLICT (report_key) DO NOTHING
               RETURNING id)
           SELECT id, true AS new FROM n
           UNION ALL
           SELECT id, false FROM feedback WHERE report_key = $2 AND NOT EXISTS (SELECT FROM n)""",
        new_id(),
        key,
        listener,
        client_ip,
        helo,
        mail_from,
        list(rcpt_to),
        body,
    )
    assert row is not None
    return row["id"], bool(row["new"])


@dataclass(frozen=True)
class Unread:
    id: uuid.UUID
    received_at: datetime
    mail_from: str
    rcpt_to: tuple[str, ...]
    body: bytes


# Seconds after which a report about a recipient still being delivered is read again: its
# outcome is recorded by then (a recorder batch commits within a second or two).
READ_AGAIN = 5.0

# What one batch reads of bodies at most (the first message whatever its size): a batch of
# large hostile messages must not take the processor's memory.
MAX_BATCH_BYTES = 32 * 1024 * 1024


async def take_new(db: Executor, limit: int, *, max_bytes: int = MAX_BATCH_BYTES) -> list[Unread]:
    """Up to `limit` unread feedback messages, oldest first, their bodies `max_bytes` together at
    most (one at least), locked for the caller's transaction (another processor passes them by;
    those left out of the batch are the next batch's)."""
    locked = await db.fetch(
        """SELECT id, length(body) AS size FROM feedback
           WHERE status = 'new' AND read_at <= now()
           ORDER BY read_at, id LIMIT $1 FOR UPDATE SKIP LOCKED""",
        limit,
    )
    ids: list[uuid.UUID] = []
    total = 0
    for row in locked:
        if ids and total + row["size"] > max_bytes:
            break
        ids.append(row["id"])
        total += row["size"]
    if not ids:
        return []
    rows = await db.fetch(
        """SELECT id, received_at, mail_from, rcpt_to, body FROM feedback
           WHERE id = ANY ($1::uuid[]) ORDER BY received_at, id""",
        ids,
    )
    return [
        Unread(r["id"], r["received_at"], r["mail_from"], tuple(r["rcpt_to"]), bytes(r["body"]))
        for r in rows
    ]


@dataclass(frozen=True)
class Target:
    """A recipient pigeon sent to, as a report may name it."""

    recipient_id: uuid.UUID
    queue_id: uuid.UUID
    org_id: uuid.UUID
    address: str
    status: str


_TARGET_COLUMNS = "r.id, r.message_id, r.org_id, r.address, r.status"


def _target(row: asyncpg.Record) -> Target:
    return Target(row["id"], row["message_id"], row["org_id"], row["address"], row["status"])


async def targets_by_id(db: Executor, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Target]:
    rows = await db.fetch(
        f"SELECT {_TARGET_COLUMNS} FROM recipient r WHERE r.id = ANY ($1::uuid[])", list(ids)
    )
    return {r["id"]: _target(r) for r in rows}


async def targets_by_message(db: Executor, header_message_id: str, address: str) -> list[Target]:
    """The recipients `address` of the messages whose Message-ID is `header_message_id`."""
    rows = await db.fetch(
        f"""SELECT {_TARGET_COLUMNS} FROM message m JOIN recipient r ON r.message_id = m.id
            WHERE m.header_message_id = $1 AND lower(r.address) = lower($2)
            ORDER BY m.received_at DESC LIMIT 20""",
        header_message_id,
        address,
    )
    return [_target(r) for r in rows]


@dataclass(frozen=True)
class Event:
    """What a report says of one recipient, to record."""

    feedback_id: uuid.UUID
    recipient_id: uuid.UUID
    kind: str  # bounce, delay, complaint
    hard: bool
    code: int | None
    enhanced_code: str | None
    response: str
    category: str | None
    feedback_type: str | None
    suppress: bool


@dataclass(frozen=True)
class Outcome:
    """What became of one feedback message."""

    feedback_id: uuid.UUID
    status: str
    kind: str | None
    detail: str


_PAYLOAD = event_payload(
    type_="e.webhook_type",
    queue_id="e.message_id",
    recipient_id="e.recipient_id",
    recipient="e.address",
    code="e.code",
    enhanced_code="e.enhanced_code",
    response="e.response",
    category="e.category",
    attempt="NULL::int",
    extra={"async": "true", "feedback_type": "e.feedback_type"},
)

_OUTBOX = outbox_insert(
    message="e.message_id",
    rows="e",
    type_="e.webhook_type",
    org_id="e.org_id",
    payload=_PAYLOAD,
    where="e.webhook_type IS NOT NULL",
)

# One statement: the events (each once per recipient and kind), the state a hard bounce moves,
# the suppression entries, the webhook events, and what became of each feedback message.
_RECORD = f"""
WITH v AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::text[], $5::bool[], $6::int[],
                         $7::text[], $8::text[], $9::text[], $10::text[], $11::bool[])
        AS v (id, feedback_id, recipient_id, kind, hard, code, enhanced_code, response,
              category, feedback_type, suppress)
), e AS (
    INSERT INTO feedback_event AS fe (id, feedback_id, recipient_id, message_id, org_id, lane,
                                      address, kind, hard, code, enhanced_code, response,
                                      category, feedback_type, changed_state)
    SELECT v.id, v.feedback_id, r.id, r.message_id, r.org_id, r.lane, r.address, v.kind, v.hard,
           v.code, v.enhanced_code, v.response, v.category, v.feedback_type,
           v.kind = 'bounce' AND v.hard AND r.status = 'delivered'
    FROM v JOIN recipient r ON r.id = v.recipient_id
    ON CONFLICT (recipient_id, kind) DO NOTHING
    RETURNING fe.id, fe.recipient_id, fe.message_id, fe.org_id, fe.address, fe.kind, fe.hard,
              fe.code, fe.enhanced_code, fe.response, fe.category, fe.feedback_type,
              fe.changed_state,
              CASE WHEN fe.kind = 'complaint' THEN 'complained'
                   WHEN fe.kind = 'bounce' AND fe.hard THEN 'bounced' END AS webhook_type
), moved AS (
    UPDATE recipient r
    SET status = 'bounced', last_code = e.code, last_enhanced_code = e.enhanced_code,
        last_response = e.response, updated_at = now()
    FROM e WHERE r.id = e.recipient_id AND e.changed_state AND r.status = 'delivered'
    RETURNING r.id
), suppressed AS (
    INSERT INTO suppression AS s (id, org_id, address, reason, source, feedback_event_id)
    SELECT DISTINCT ON (e.org_id, lower(e.address))
           e.id, e.org_id, lower(e.address),
           CASE WHEN e.kind = 'complaint'
                THEN 'complaint (' || COALESCE(e.feedback_type, 'abuse') || ')'
                ELSE 'async bounce: ' || left(e.response, 200) END,
           CASE WHEN e.kind = 'complaint' THEN 'complaint' ELSE 'bounce' END, e.id
    FROM e JOIN v ON v.id = e.id
    WHERE v.suppress
    ORDER BY e.org_id, lower(e.address), e.id
    ON CONFLICT (org_id, address) DO UPDATE
    SET reason = EXCLUDED.reason, source = EXCLUDED.source, attempt_id = NULL,
        feedback_event_id = EXCLUDED.feedback_event_id, created_at = now(), expires_at = NULL
    WHERE s.source <> 'manual' OR NOT {SUPPRESSION_ACTIVE}
    RETURNING s.id
), w AS (
    {_OUTBOX}
)
UPDATE feedback f
SET status = o.status, kind = o.kind, detail = o.detail, processed_at = now(),
    read_at = CASE WHEN o.status = 'new' THEN now() + make_interval(secs => $16) ELSE f.read_at END
FROM unnest($12::uuid[], $13::text[], $14::text[], $15::text[]) AS o (id, status, kind, detail)
WHERE f.id = o.id
RETURNING f.id, (SELECT count(*) FROM e) AS events,
          (SELECT array_agg(id) FROM moved) AS moved,
          (SELECT count(*) FROM suppressed) AS suppressed
"""


@dataclass(frozen=True)
class Recorded:
    events: int  # new events (a repeat's are not)
    moved: list[uuid.UUID]  # the delivered recipients now bounced
    suppressed: int


async def record(db: Executor, events: Sequence[Event], outcomes: Sequence[Outcome]) -> Recorded:
    """Record a batch's events and outcomes in one statement (call it in the transaction that
    took the messages)."""
    if not outcomes:
        return Recorded(0, [], 0)
    rows = await db.fetch(
        _RECORD,
        new_ids(len(events)),
        [e.feedback_id for e in events],
        [e.recipient_id for e in events],
        [e.kind for e in events],
        [e.hard for e in events],
        [e.code for e in events],
        [e.enhanced_code for e in events],
        [e.response for e in events],
        [e.category for e in events],
        [e.feedback_type for e in events],
        [e.suppress for e in events],
        [o.feedback_id for o in outcomes],
        [o.status for o in outcomes],
        [o.kind for o in outcomes],
        [o.detail for o in outcomes],
        READ_AGAIN,
    )
    if not rows:
        return Recorded(0, [], 0)
    first = rows[0]
    return Recorded(int(first["events"]), list(first["moved"] or []), int(first["suppressed"]))


# ---------------------------------------------------------------- reading back


@dataclass(frozen=True)
class Kept:
    id: uuid.UUID
    received_at: datetime
    status: str
    kind: str | None
    mail_from: str
    rcpt_to: tuple[str, ...]
    client_ip: str | None
    size: int
    detail: str | None
    subject: str | None


_KEPT_COLUMNS = """id, received_at, status, kind, mail_from, rcpt_to, host(client_ip) AS client_ip,
    length(body) AS size, detail,
    substring(convert_from(substring(body FROM 1 FOR 8192), 'SQL_ASCII')
              FROM '(?im)^Subject:[ \\t]*([^\\r\\n]{0,200})') AS subject"""


def _kept(row: asyncpg.Record) -> Kept:
    return Kept(
        row["id"],
        row["received_at"],
        row["status"],
        row["kind"],
        row["mail_from"],
        tuple(row["rcpt_to"]),
        row["client_ip"],
        row["size"],
        row["detail"],
        row["subject"],
    )


async def list_kept(db: Executor, *, status: str | None, limit: int) -> list[Kept]:
    """The newest feedback messages, of one status or all."""
    rows = await db.fetch(
        f"""SELECT {_KEPT_COLUMNS} FROM feedback
            WHERE $1::text IS NULL OR status = $1 ORDER BY received_at DESC LIMIT $2""",
        status,
        limit,
    )
    return [_kept(r) for r in rows]


@dataclass(frozen=True)
class RecordedEvent:
    id: uuid.UUID
    feedback_id: uuid.UUID
    recipient_id: uuid.UUID
    queue_id: uuid.UUID
    org_id: uuid.UUID
    address: str
    kind: str
    hard: bool
    code: int | None
    enhanced_code: str | None
    response: str | None
    category: str | None
    feedback_type: str | None
    changed_state: bool
    recorded_at: datetime


_EVENT_COLUMNS = """id, feedback_id, recipient_id, message_id, org_id, address, kind, hard, code, enhanced_code,
    response, category, feedback_type, changed_state, recorded_at"""


def _event(row: asyncpg.Record) -> RecordedEvent:
    return RecordedEvent(
        row["id"],
        row["feedback_id"],
        row["recipient_id"],
        row["message_id"],
        row["org_id"],
        row["address"],
        row["kind"],
        row["hard"],
        row["code"],
        row["enhanced_code"],
        row["response"],
        row["category"],
        row["feedback_type"],
        row["changed_state"],
        row["recorded_at"],
    )


async def show_kept(
    db: Executor, feedback_id: uuid.UUID
) -> tuple[Kept, bytes, list[RecordedEvent]] | None:
    """One feedback message: what is known of it, its body as it came, its events."""
    row = await db.fetchrow(
        f"SELECT {_KEPT_COLUMNS}, body FROM feedback WHERE id = $1", feedback_id
    )
    if row is None:
        return None
    events = await db.fetch(
        f"SELECT {_EVENT_COLUMNS} FROM feedback_event WHERE feedback_id = $1 ORDER BY recorded_at",
        feedback_id,
    )
    return _kept(row), bytes(row["body"]), [_event(e) for e in events]


async def events_of_recipients(
    db: Executor, recipient_ids: Sequence[uuid.UUID]
) -> list[RecordedEvent]:
    """The feedback events of these recipients, oldest first (the timeline's later events)."""
    rows = await db.fetch(
        f"""SELECT {_EVENT_COLUMNS} FROM feedback_event WHERE recipient_id = ANY ($1::uuid[])
            ORDER BY recorded_at, id""",
        list(recipient_ids),
    )
    return [_event(r) for r in rows]
