"""Reading a message's story back from the database: its reception, recipients and attempts.

The message row is the Reception event and each attempt row is a later event, so the delivery
log can always be rebuilt from here. These are admin reads across orgs (an operator asks "where
is message X"), served by indexes: the primary keys, message_header_id, recipient_address,
recipient_message and attempt_recipient.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from pigeon_mta.model import DSN_LISTENER
from pigeon_mta.store import suspensions
from pigeon_mta.store.duplicates import DuplicateRecord, duplicates_of
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.feedback import RecordedEvent as FeedbackEvent
from pigeon_mta.store.feedback import events_of_recipients


@dataclass(frozen=True)
class MessageRecord:
    id: uuid.UUID  # the queue id
    org_id: uuid.UUID
    org_name: str
    sender: str
    header_message_id: str | None
    size: int
    received_at: datetime
    listener: str
    client_ip: str | None
    client_helo: str | None
    auth_user: str | None
    tls_version: str | None = None
    tls_cipher: str | None = None
    lane: str = "transactional"  # the lane it is delivered in
    # The message queued earlier under the same Message-ID with other content, within the
    # duplicate window: this one was not taken for a duplicate of it.
    reuses: uuid.UUID | None = None
    # The send intent (intake/intent.py); metadata {} when it has none.
    expires_at: datetime | None = None
    send_at: datetime | None = None
    order_key: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RecipientRecord:
    id: uuid.UUID
    queue_id: uuid.UUID
    address: str
    status: str
    attempts: int
    next_attempt_at: datetime
    last_code: int | None
    last_enhanced_code: str | None
    last_response: str | None
    updated_at: datetime
    # Why it was handed back unattempted (a budget without room, a destination backing off).
    postponed: str | None = None


@dataclass(frozen=True)
class AttemptRecord:
    id: uuid.UUID
    recipient_id: uuid.UUID
    queue_id: uuid.UUID
    attempt: int
    started_at: datetime
    duration: float  # seconds
    mx_host: str | None
    ip: str | None
    port: int | None
    tls_version: str | None
    tls_cipher: str | None
    code: int | None
    enhanced_code: str | None
    response: str | None
    outcome: str
    category: str | None
    next_attempt_at: datetime | None
    applied: bool
    dkim: str | None = None  # how the message sent was signed, or why not (signer.py)
    rule: str | None = None  # the classification rules that judged it ("; shaping NAME: ...")


@dataclass(frozen=True)
class MessageStory:
    """One message, the recipients asked about (all, unless found by address), their attempts."""

    message: MessageRecord
    recipients: tuple[RecipientRecord, ...]
    attempts: tuple[AttemptRecord, ...]  # in the order they happened
    # What a failure caused, by attempt id (see `consequences`): the queue id of the DSN that
    # told the sender, and the address its bounce put on the suppression list.
    dsns: Mapping[uuid.UUID, uuid.UUID] = field(default_factory=dict)
    suppressed: Mapping[uuid.UUID, str] = field(default_factory=dict)
    # Later submissions that named its recipients again and were not queued again, oldest first.
    duplicates: tuple[DuplicateRecord, ...] = ()
    # What bounces arriving later and complaint reports said of its recipients (feedback/).
    feedback: tuple[FeedbackEvent, ...] = ()


# ---------------------------------------------------------------- finding messages

_MESSAGE_COLUMNS = """m.id, m.org_id, o.name AS org_name, m.sender, m.header_message_id, m.size,
    m.received_at, m.listener, host(m.client_ip) AS client_ip, m.client_helo, m.auth_user,
    m.tls_version, m.tls_cipher, m.lane, m.reuses, m.expires_at, m.send_at, m.order_key,
    m.metadata::text AS metadata"""

_BY_QUEUE_ID = f"""
SELECT {_MESSAGE_COLUMNS} FROM message m JOIN org o ON o.id = m.org_id WHERE m.id = $1
"""

_BY_QUEUE_IDS = f"""
SELECT {_MESSAGE_COLUMNS} FROM message m JOIN org o ON o.id = m.org_id WHERE m.id = ANY ($1::uuid[])
ORDER BY m.received_at
"""

_BY_HEADER_ID = f"""
SELECT {_MESSAGE_COLUMNS} FROM message m JOIN org o ON o.id = m.org_id
WHERE m.header_message_id = $1
ORDER BY m.received_at DESC LIMIT $2
"""

# The newest messages to an address, through recipient_address (address, created_at): the newest
# $2 of each spelling, read backwards from the index, then the newest $2 of those. (For
# "address = ANY (spellings)" the index has no single order: PostgreSQL reads the address's whole
# history and sorts it to keep ten, 0.3-0.9 s for 20,000 messages, bench/admin_bench.py.)
_TO_ADDRESS = f"""
SELECT {_MESSAGE_COLUMNS} FROM message m JOIN org o ON o.id = m.org_id
WHERE m.id IN (SELECT newest.message_id
               FROM unnest($1::text[]) AS spelling (address)
               CROSS JOIN LATERAL (SELECT r.message_id, r.created_at FROM recipient r
                                   WHERE r.address = spelling.address
                                   ORDER BY r.created_at DESC LIMIT $2) newest
               ORDER BY newest.created_at DESC LIMIT $2)
ORDER BY m.received_at DESC
"""


def _message(row: asyncpg.Record) -> MessageRecord:
    return MessageRecord(
        id=row["id"],
        org_id=row["org_id"],
        org_name=row["org_name"],
        sender=row["sender"],
        header_message_id=row["header_message_id"],
        size=row["size"],
        received_at=row["received_at"],
        listener=row["listener"],
        client_ip=row["client_ip"],
        client_helo=row["client_helo"],
        auth_user=row["auth_user"],
        tls_version=row["tls_version"],
        tls_cipher=row["tls_cipher"],
        lane=row["lane"],
        reuses=row["reuses"],
        expires_at=row["expires_at"],
        send_at=row["send_at"],
        order_key=row["order_key"],
        metadata=json.loads(row["metadata"]) if row["metadata"] else {},
    )


async def message_by_queue_id(db: Executor, queue_id: uuid.UUID) -> MessageRecord | None:
    row = await db.fetchrow(_BY_QUEUE_ID, queue_id)
    return _message(row) if row else None


async def messages_by_header_id(db: Executor, header_id: str, *, limit: int) -> list[MessageRecord]:
    """Messages whose Message-ID header is `header_id` (stored without angle brackets)."""
    return [_message(r) for r in await db.fetch(_BY_HEADER_ID, header_id, limit)]


async def messages_to_address(
    db: Executor, addresses: Sequence[str], *, limit: int
) -> list[MessageRecord]:
    """The newest `limit` messages with a recipient spelled as one of `addresses`."""
    return [_message(r) for r in await db.fetch(_TO_ADDRESS, list(addresses), limit)]


# ---------------------------------------------------------------- recipients and attempts

# A queued recipient that an operator's suspension holds says so (store/suspensions.py), whether
# it was queued before the suspension or after.
_RECIPIENTS = f"""
SELECT r.id, r.message_id, r.address, r.status, r.attempts, r.next_attempt_at, r.last_code,
       r.last_enhanced_code, r.last_response, r.updated_at,
       COALESCE((SELECT {suspensions.NOTE}
                 FROM suspension x
                 WHERE r.status = 'queued' AND {suspensions.ACTIVE}
                   AND x.key IN ('org:' || r.org_id, 'lane:' || r.lane, 'domain:' || r.domain,
                                 r.site)
                 ORDER BY x.created_at LIMIT 1), r.postponed) AS postponed
FROM recipient r WHERE r.message_id = ANY ($1::uuid[])
ORDER BY r.message_id, r.address
"""

_ATTEMPTS = """
SELECT id, recipient_id, message_id, attempt, started_at, duration_ms, mx_host, ip, port,
       tls_version, tls_cipher, code, enhanced_code, response, outcome, category,
       next_attempt_at, applied, dkim, rule
FROM attempt
WHERE recipient_id IN (SELECT id FROM recipient WHERE message_id = ANY ($1::uuid[]))
ORDER BY started_at, attempt, recorded_at, id
"""


def _recipient(row: asyncpg.Record) -> RecipientRecord:
    return RecipientRecord(
        id=row["id"],
        queue_id=row["message_id"],
        address=row["address"],
        status=row["status"],
        attempts=row["attempts"],
        next_attempt_at=row["next_attempt_at"],
        last_code=row["last_code"],
        last_enhanced_code=row["last_enhanced_code"],
        last_response=row["last_response"],
        updated_at=row["updated_at"],
        postponed=row["postponed"],
    )


def _attempt(row: asyncpg.Record) -> AttemptRecord:
    return AttemptRecord(
        id=row["id"],
        recipient_id=row["recipient_id"],
        queue_id=row["message_id"],
        attempt=row["attempt"],
        started_at=row["started_at"],
        duration=float(row["duration_ms"]) / 1000.0,
        mx_host=row["mx_host"],
        ip=row["ip"],
        port=row["port"],
        tls_version=row["tls_version"],
        tls_cipher=row["tls_cipher"],
        code=row["code"],
        enhanced_code=row["enhanced_code"],
        response=row["response"],
        outcome=row["outcome"],
        category=row["category"],
        next_attempt_at=row["next_attempt_at"],
        applied=row["applied"],
        dkim=row["dkim"],
        rule=row["rule"],
    )


async def recipients_of(db: Executor, queue_ids: Sequence[uuid.UUID]) -> list[RecipientRecord]:
    """The recipients of these messages, by message and address."""
    return [_recipient(r) for r in await db.fetch(_RECIPIENTS, list(queue_ids))]


async def stories_of(
    db: Executor, messages: Sequence[MessageRecord], *, addresses: Sequence[str] = ()
) -> list[MessageStory]:
    """The stories of `messages` (in the order given); only `addresses` when any are given."""
    ids = [m.id for m in messages]
    recipients = await recipients_of(db, ids)
    wanted = set(addresses)
    if addresses:
        recipients = [r for r in recipients if r.address in wanted]
    kept = {r.id for r in recipients}
    attempts = [_attempt(a) for a in await db.fetch(_ATTEMPTS, ids)]
    dsns, suppressed = await consequences(
        db, [a for a in attempts if a.recipient_id in kept], recipients, messages
    )
    duplicates = await duplicates_of(db, ids)
    if addresses:
        duplicates = [d for d in duplicates if d.address in wanted]
    feedback = await events_of_recipients(db, list(kept))
    return [
        MessageStory(
            message=m,
            recipients=tuple(r for r in recipients if r.queue_id == m.id),
            attempts=tuple(a for a in attempts if a.queue_id == m.id and a.recipient_id in kept),
            dsns=dsns,
            suppressed=suppressed,
            duplicates=tuple(d for d in duplicates if d.original_id == m.id),
            feedback=tuple(f for f in feedback if f.queue_id == m.id),
        )
        for m in messages
    ]


# ---------------------------------------------------------------- what a failure caused

# A DSN is queued in the transaction that records the bounce or expiry it reports
# (dsn_queue.py), so its message row's received_at is the attempt row's recorded_at (both are
# that transaction's now()); among the DSNs of that instant (one per message failed in the round)
# its delivery-status part names the original's queue id. Served by message_org_received.
_DSNS = f"""
SELECT a.id AS attempt_id, d.id AS dsn_id
FROM attempt a
CROSS JOIN LATERAL (
    SELECT m.id FROM message m
    WHERE m.org_id = a.org_id AND m.received_at = a.recorded_at
      AND m.listener = '{DSN_LISTENER}' AND m.sender = ''
      AND position(convert_to('X-Pigeon-Queue-ID: ' || a.message_id::text, 'UTF8') IN m.body) > 0
    ORDER BY m.id LIMIT 1
) d
WHERE a.id = ANY ($1::uuid[])
"""

# A bounce's suppression entry points at its attempt (until a later bounce or an operator
# replaces it); looked up by the list's key, (org_id, address).
_SUPPRESSED = """
SELECT s.attempt_id, s.address FROM suppression s
WHERE s.org_id = ANY ($1::uuid[])
  AND s.address = ANY (SELECT lower(x) FROM unnest($2::text[]) AS x)
  AND s.attempt_id = ANY ($3::uuid[])
"""


async def consequences(
    db: Executor,
    attempts: Sequence[AttemptRecord],
    recipients: Sequence[RecipientRecord],
    messages: Sequence[MessageRecord],
) -> tuple[dict[uuid.UUID, uuid.UUID], dict[uuid.UUID, str]]:
    """For the bounces and expiries among `attempts`: the DSN each queued and the suppression
    entry each made, by attempt id."""
    failed = [a for a in attempts if a.applied and a.outcome in ("bounced", "expired")]
    if not failed:
        return {}, {}
    dsn_rows = await db.fetch(_DSNS, [a.id for a in failed])
    failed_recipients = {a.recipient_id for a in failed}
    suppressed_rows = await db.fetch(
        _SUPPRESSED,
        list({m.org_id for m in messages}),
        list({r.address for r in recipients if r.id in failed_recipients}),
        [a.id for a in failed if a.outcome == "bounced"],
    )
    return (
        {r["attempt_id"]: r["dsn_id"] for r in dsn_rows},
        {r["attempt_id"]: r["address"] for r in suppressed_rows},
    )


# ---------------------------------------------------------------- expiry, for the delivery log

_EXPIRED = """
SELECT id, recipient_id, message_id, attempt, started_at, duration_ms, mx_host, ip, port,
       tls_version, tls_cipher, code, enhanced_code, response, outcome, category,
       next_attempt_at, applied, dkim, rule
FROM attempt WHERE recipient_id = ANY ($1::uuid[]) AND outcome = 'expired'
ORDER BY started_at, id
"""


async def expiry_stories(db: Executor, recipient_ids: Sequence[uuid.UUID]) -> list[MessageStory]:
    """The expiry events of recipients the sweeper just expired, with their messages."""
    attempts = [_attempt(a) for a in await db.fetch(_EXPIRED, list(recipient_ids))]
    queue_ids = list(dict.fromkeys(a.queue_id for a in attempts))
    messages = [_message(r) for r in await db.fetch(_BY_QUEUE_IDS, queue_ids)]
    recipients = [_recipient(r) for r in await db.fetch(_RECIPIENTS, queue_ids)]
    wanted = set(recipient_ids)
    return [
        MessageStory(
            message=m,
            recipients=tuple(r for r in recipients if r.queue_id == m.id and r.id in wanted),
            attempts=tuple(a for a in attempts if a.queue_id == m.id),
        )
        for m in messages
    ]


# ---------------------------------------------------------------- `pigeon-mta log REF`


@dataclass(frozen=True)
class Lookup:
    found_by: str  # "queue id", "Message-ID" or "recipient address"
    stories: list[MessageStory]  # oldest first


def address_spellings(address: str) -> list[str]:
    """An address as typed, with its domain lower-cased, and all lower-case.

    Domains are case-insensitive; local parts are not in theory but are in practice, and the
    recipient column keeps what the client sent.
    """
    local, _, domain = address.strip().rpartition("@")
    spellings = [address.strip(), f"{local}@{domain.lower()}", address.strip().lower()]
    return list(dict.fromkeys(spellings))


async def story_of_org_message(
    db: Executor, queue_id: uuid.UUID, org_id: uuid.UUID
) -> MessageStory | None:
    """The whole story of one message of an org (the HTTP API's timeline); None when the queue id
    is unknown or another org's: the two are not told apart."""
    message = await message_by_queue_id(db, queue_id)
    if message is None or message.org_id != org_id:
        return None
    (story,) = await stories_of(db, [message])
    return story


async def find_stories(db: Executor, ref: str, *, limit: int) -> Lookup | None:
    """The messages `ref` names: a queue id, else a Message-ID (with or without <>), else the
    newest `limit` messages to a recipient address. None when nothing matches."""
    ref = ref.strip()
    try:
        queue_id: uuid.UUID | None = uuid.UUID(ref)
    except ValueError:
        queue_id = None
    if queue_id is not None:
        message = await message_by_queue_id(db, queue_id)
        if message is not None:
            return Lookup("queue id", await stories_of(db, [message]))
    bracketed = ref.startswith("<") and ref.endswith(">")
    header_id = ref[1:-1] if bracketed else ref
    found = await messages_by_header_id(db, header_id, limit=limit)
    if found:
        return Lookup("Message-ID", await stories_of(db, found[::-1]))
    if bracketed or "@" not in ref:
        return None
    spellings = address_spellings(ref)
    found = await messages_to_address(db, spellings, limit=limit)
    if found:
        return Lookup("recipient address", await stories_of(db, found[::-1], addresses=spellings))
    return None
