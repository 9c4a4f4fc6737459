"""Duplicate submissions: the submission path's enqueue, which queues each recipient once per
(org, Message-ID, address) within `limits.duplicate_window`, the record of the duplicates, and
their pruning.

An application that retries after a lost `250` sends the same message again. It is decided per
recipient, not per message: a client that splits one message's recipients over several
transactions (Postfix does above its recipient limit) must still reach everyone. Only a Message-ID
the client supplied counts (the handler says so through `Envelope.duplicate_window`); addresses
compare as the suppression list compares them, by PostgreSQL's lower().

The decision is made in the enqueue statement itself, on the primary key of `submission_dedup`
(migration 0016): of two identical submissions in parallel, the second waits for the first one's
commit and then finds its entries, so one message is queued. The message row, its new recipients,
the entries and the duplicates' records are one statement, one commit, as in store/queue.py.

Almost every message is new, so it is first written with plain INSERTs of its entries: they add
half as much to PostgreSQL's CPU per message as INSERT ... ON CONFLICT and the duplicates'
bookkeeping do (bench/README.md, "End to end"). An entry already there (a duplicate, an ended
window not pruned yet, a twin in parallel or in the same batch) makes that statement fail on the
primary key, having written nothing; then the statement with ON CONFLICT decides. PostgreSQL's own
log shows that failure as an ERROR (a duplicate key in submission_dedup_pkey), once per duplicate
submission.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import id_floor
from pigeon_mta.model import Envelope
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class Duplicates:
    """The recipients of one submitted message that were queued already within its window."""

    # Each such address, as the client wrote it, with the queue id of the message that holds it.
    originals: dict[str, uuid.UUID]
    # The queue id the client is answered: the submitted message's own when some recipients were
    # new (it was queued for them), else the oldest of the originals.
    reply_id: uuid.UUID


def message_key(message_id: str) -> uuid.UUID:
    """The key a Message-ID is stored under: BLAKE2b-128 of its text, so that a Message-ID of any
    length fits the index, and two different ones do not meet by chance."""
    digest = hashlib.blake2b(message_id.encode("utf-8", "surrogatepass"), digest_size=16)
    return uuid.UUID(bytes=digest.digest())


def _checked(envelope: Envelope) -> bool:
    return bool(envelope.duplicate_window > 0 and envelope.header_message_id)


# The entries of the plain statements (store/queue.py's enqueue with `before`), in key order so that
# concurrent statements take their locks in one order. No ON CONFLICT: an entry already there, or
# twice in the statement, fails it on the primary key (PRIMARY_KEY), and _ENQUEUE_ONE or
# _ENQUEUE_MANY below decides.
_NEW_ENTRIES_ONE = """d AS (
    INSERT INTO submission_dedup (org_id, message_key, address, queue_id, expires_at,
                                  content_key)
    SELECT :org_id::uuid, :message_key::uuid, lower(a), :id::uuid, now() + make_interval(secs => :window::float8),
           :content_key::bytea
    FROM unnest(:addresses::text[]) AS a
    ORDER BY 3
), """
_NEW_ENTRIES_MANY = """d AS (
    INSERT INTO submission_dedup (org_id, message_key, address, queue_id, expires_at,
                                  content_key)
    SELECT u.org_id, u.message_key, lower(v.address), u.id,
           now() + make_interval(secs => u.window_secs), u.content_key
    FROM unnest(:id::uuid[], :org_id::uuid[], :message_key::uuid[], :window::float8[], :content_key::bytea[])
         AS u (id, org_id, message_key, window_secs, content_key)
    JOIN unnest(:recipient_queue_ids::uuid[], :addresses::text[]) AS v (message_id, address) ON v.message_id = u.id
    WHERE u.message_key IS NOT NULL
    ORDER BY 1, 2, 3
), """
# The parameters of each statement: the enqueue's (store/queue.py), then the duplicate rule's;
# the statements that decide take no handoff.
_DUPLICATE_PARAMETERS = ("message_key", "window", "content_key")
_NEW_ONE_PARAMETERS = (*store_queue.ONE_PARAMETERS, *_DUPLICATE_PARAMETERS)
_NEW_MANY_PARAMETERS = (*store_queue.MANY_PARAMETERS, *_DUPLICATE_PARAMETERS)
_ONE_PARAMETERS = (*store_queue.without_handoff(store_queue.ONE_PARAMETERS), *_DUPLICATE_PARAMETERS)
_MANY_PARAMETERS = (
    *store_queue.without_handoff(store_queue.MANY_PARAMETERS),
    *_DUPLICATE_PARAMETERS,
)
_ENQUEUE_NEW_ONE = store_queue.enqueue_statement(
    many=False, before=_NEW_ENTRIES_ONE, names=_NEW_ONE_PARAMETERS
)
_ENQUEUE_NEW_MANY = store_queue.enqueue_statement(
    many=True, before=_NEW_ENTRIES_MANY, names=_NEW_MANY_PARAMETERS
)
PRIMARY_KEY = "submission_dedup_pkey"


# An entry still in force for the same content keeps its message and its expiry; one whose window
# has ended, or made for other content under the same Message-ID, is taken over by the message
# queued now (so a retry of the first content that comes after the second is queued again: the
# entry holds one content per Message-ID and recipient, and errs toward delivering twice). An
# entry without a content key, written before they were kept, matches any. The
# UPDATE happens on every conflict (rare: only duplicates), because only an updated row is
# RETURNED, and the statement needs the original's queue id.
_SAME = """(s.expires_at > now() AND (s.content_key IS NULL OR EXCLUDED.content_key IS NULL
                                    OR s.content_key = EXCLUDED.content_key))"""
_TAKE_OVER = f"""
    ON CONFLICT (org_id, message_key, address) DO UPDATE
    SET queue_id = CASE WHEN {_SAME} THEN s.queue_id ELSE EXCLUDED.queue_id END,
        expires_at = CASE WHEN {_SAME} THEN s.expires_at ELSE EXCLUDED.expires_at END,
        content_key = CASE WHEN {_SAME} THEN s.content_key ELSE EXCLUDED.content_key END
"""

# The entries in force under the same Message-ID for other content: the message is queued anyway,
# and it names the one it reuses the Message-ID of (read before this statement's own writes).
_OTHER_CONTENT = """
    s.expires_at > now() AND s.content_key IS NOT NULL AND {content} IS NOT NULL
    AND s.content_key <> {content}
"""

# One message: its recipients' entries (each key once: "A@x" and "a@x" are one entry), in key
# order so that concurrent statements take their row locks in one order; `k` pairs each recipient
# with the message that queues it (`owner`); the message row and its recipients only for those
# it owns; a duplicate_reception row for the others.
_ENQUEUE_ONE = store_queue.bind(
    f"""
WITH reused AS (
    SELECT s.queue_id FROM submission_dedup s
    WHERE s.org_id = :org_id::uuid AND s.message_key = :message_key::uuid
      AND s.address = ANY (ARRAY (SELECT lower(a) FROM unnest(:addresses::text[]) AS a))
      AND {_OTHER_CONTENT.format(content=":content_key::bytea")}
    ORDER BY s.queue_id LIMIT 1
), d AS (
    INSERT INTO submission_dedup AS s (org_id, message_key, address, queue_id, expires_at,
                                       content_key)
    SELECT DISTINCT :org_id::uuid, :message_key::uuid, lower(a), :id::uuid, now() + make_interval(secs => :window),
           :content_key::bytea
    FROM unnest(:addresses::text[]) AS a
    ORDER BY 3
    {_TAKE_OVER}
    RETURNING s.address, s.queue_id
), k AS (
    SELECT u.id, u.address, u.domain, d.queue_id AS owner
    FROM unnest(:recipient_ids::uuid[], :addresses::text[], :domains::text[]) AS u (id, address, domain)
    JOIN d ON d.address = lower(u.address)
), m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher, lane, reuses, expires_at, send_at, order_key,
                         metadata)
    SELECT :id, :org_id, :sender::text, :header_message_id::text, :size::int, :body::bytea, :listener::text, :client_ip::inet, :client_helo::text,
           :credential_id::uuid, :auth_user::text, COALESCE(:received_at::timestamptz, now()), :tls_version::text, :tls_cipher::text,
           :lane::text, (SELECT queue_id FROM reused), :expires_at::timestamptz, :send_at::timestamptz,
           :order_key::text, :metadata::jsonb
    WHERE EXISTS (SELECT 1 FROM k WHERE k.owner = :id)
    RETURNING id, org_id, COALESCE(send_at, received_at) AS queued_at, lane, order_key,
              received_at
), r AS (
    INSERT INTO recipient (id, message_id, org_id, address, domain, created_at, next_attempt_at,
                           lane, order_key, order_at)
    SELECT k.id, m.id, m.org_id, k.address, k.domain, m.queued_at, m.queued_at, m.lane,
           m.order_key, CASE WHEN m.order_key IS NOT NULL THEN m.received_at END
    FROM m JOIN k ON k.owner = m.id
), reply AS (
    SELECT owner AS id FROM k ORDER BY owner = :id DESC, owner LIMIT 1
), x AS (
    INSERT INTO duplicate_reception (id, org_id, original_id, reply_id, header_message_id, sender,
                                     address, received_at, listener, client_ip, client_helo,
                                     auth_user, size, tls_version, tls_cipher)
    SELECT k.id, :org_id, k.owner, reply.id, :header_message_id, :sender, k.address, COALESCE(:received_at::timestamptz, now()),
           :listener, :client_ip::inet, :client_helo, :auth_user, :size, :tls_version, :tls_cipher
    FROM k, reply
    WHERE k.owner <> :id
    RETURNING address, original_id, reply_id
)
SELECT :id AS message_id, address, original_id, reply_id FROM x
""",
    _ONE_PARAMETERS,
)

# Several messages (a group commit), as above. The per-message columns the decision needs are
# unnested once into `u` (a CTE read several times is computed once); the bodies are not, so that
# they are not copied into it. Within the batch, the same key in two messages goes to the one with
# the smaller queue id (a UUIDv7: received first, to the millisecond); the other is its duplicate. Messages without a key pass
# through: each of their recipients is its own owner.
_ENQUEUE_MANY = store_queue.bind(
    f"""
WITH u AS (
    SELECT * FROM unnest(:id::uuid[], :org_id::uuid[], :message_key::uuid[], :window::float8[], :content_key::bytea[])
        AS u (id, org_id, message_key, window_secs, content_key)
), v AS (
    SELECT * FROM unnest(:recipient_ids::uuid[], :recipient_queue_ids::uuid[], :addresses::text[], :domains::text[])
        AS v (id, message_id, address, domain)
), reused AS (
    SELECT DISTINCT ON (u.id) u.id, s.queue_id FROM u JOIN v ON v.message_id = u.id
    JOIN submission_dedup s ON s.org_id = u.org_id AND s.message_key = u.message_key
                           AND s.address = lower(v.address)
    WHERE {_OTHER_CONTENT.format(content="u.content_key")}
    ORDER BY u.id, s.queue_id
), d AS (
    INSERT INTO submission_dedup AS s (org_id, message_key, address, queue_id, expires_at,
                                       content_key)
    SELECT DISTINCT ON (u.org_id, u.message_key, lower(v.address))
           u.org_id, u.message_key, lower(v.address), u.id,
           now() + make_interval(secs => u.window_secs), u.content_key
    FROM u JOIN v ON v.message_id = u.id
    WHERE u.message_key IS NOT NULL
    ORDER BY u.org_id, u.message_key, lower(v.address), u.id
    {_TAKE_OVER}
    RETURNING s.org_id, s.message_key, s.address, s.queue_id
), k AS (
    SELECT v.id, v.message_id, v.address, v.domain, COALESCE(d.queue_id, v.message_id) AS owner
    FROM v JOIN u ON u.id = v.message_id
    LEFT JOIN d ON d.org_id = u.org_id AND d.message_key = u.message_key
               AND d.address = lower(v.address)
), m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher, lane, reuses, expires_at, send_at, order_key,
                         metadata)
    SELECT w.id, w.org_id, w.sender, w.header_message_id, w.size, w.body, w.listener,
           w.client_ip, w.client_helo, w.credential_id, w.auth_user,
           COALESCE(w.received_at, now()), w.tls_version, w.tls_cipher, w.lane,
           (SELECT r.queue_id FROM reused r WHERE r.id = w.id), w.expires_at, w.send_at,
           w.order_key, w.metadata
    FROM unnest(:id::uuid[], :org_id::uuid[], :sender::text[], :header_message_id::text[], :size::int[], :body::bytea[],
                :listener::text[], :client_ip::inet[], :client_helo::text[], :credential_id::uuid[], :auth_user::text[],
                :received_at::timestamptz[], :tls_version::text[], :tls_cipher::text[], :lane::text[],
                :expires_at::timestamptz[], :send_at::timestamptz[], :order_key::text[], :metadata::jsonb[])
         AS w (id, org_id, sender, header_message_id, size, body, listener, client_ip,
               client_helo, credential_id, auth_user, received_at, tls_version, tls_cipher,
               lane, expires_at, send_at, order_key, metadata)
    WHERE EXISTS (SELECT 1 FROM k WHERE k.message_id = w.id AND k.owner = w.id)
    RETURNING id, org_id, COALESCE(send_at, received_at) AS queued_at, lane, order_key,
              received_at
), r AS (
    INSERT INTO recipient (id, message_id, org_id, address, domain, created_at, next_attempt_at,
                           lane, order_key, order_at)
    SELECT k.id, m.id, m.org_id, k.address, k.domain, m.queued_at, m.queued_at, m.lane,
           m.order_key, CASE WHEN m.order_key IS NOT NULL THEN m.received_at END
    FROM m JOIN k ON k.message_id = m.id AND k.owner = m.id
), dm AS (  -- the messages with duplicates, without their bodies
    SELECT * FROM unnest(:id::uuid[], :org_id::uuid[], :sender::text[], :header_message_id::text[], :size::int[],
                         :listener::text[], :client_ip::inet[], :client_helo::text[], :auth_user::text[], :received_at::timestamptz[],
                         :tls_version::text[], :tls_cipher::text[])
        AS n (id, org_id, sender, header_message_id, size, listener, client_ip, client_helo,
              auth_user, received_at, tls_version, tls_cipher)
    WHERE EXISTS (SELECT 1 FROM k WHERE k.message_id = n.id AND k.owner <> n.id)
), x AS (
    INSERT INTO duplicate_reception (id, org_id, original_id, reply_id, header_message_id, sender,
                                     address, received_at, listener, client_ip, client_helo,
                                     auth_user, size, tls_version, tls_cipher)
    SELECT k.id, n.org_id, k.owner, reply.id, n.header_message_id, n.sender, k.address,
           COALESCE(n.received_at, now()), n.listener, n.client_ip, n.client_helo, n.auth_user,
           n.size, n.tls_version, n.tls_cipher
    FROM dm n JOIN k ON k.message_id = n.id
    CROSS JOIN LATERAL (
        SELECT o.owner AS id FROM k o WHERE o.message_id = n.id
        ORDER BY o.owner = n.id DESC, o.owner LIMIT 1
    ) reply
    WHERE k.owner <> n.id
    RETURNING id, original_id, reply_id
)
SELECT k.message_id, k.address, x.original_id, x.reply_id FROM x JOIN k ON k.id = x.id
""",
    _MANY_PARAMETERS,
)


@dataclass(frozen=True)
class Enqueued:
    """What a submission commit did besides queueing."""

    # The duplicates by queue id, for the messages that had any (normally none).
    duplicates: dict[uuid.UUID, Duplicates]
    # Whether the messages with a handoff were queued claimed by its engine (model.Handoff);
    # after a duplicate, they are queued for a claim like the others.
    handed_off: bool
    # The handed-off recipients on their org's suppression list: reason by recipient id.
    suppressed: dict[uuid.UUID, str]


async def enqueue_submitted(db: Executor, batch: Sequence[tuple[uuid.UUID, Envelope]]) -> Enqueued:
    """Queue submitted messages (queue id, envelope) in one statement, all of them or none, as
    `store.queue.enqueue_many` does without NOTIFY; but a recipient of a message with a
    `duplicate_window` that its org queued under the same Message-ID within that window is not
    queued again, and a message all of whose recipients are such is not queued at all.
    """
    if not any(_checked(e) for _q, e in batch):
        return Enqueued({}, True, await store_queue.enqueue_many(db, batch))
    for _queue_id, envelope in batch:
        if not envelope.recipients:
            raise ValueError("a message needs at least one recipient")
    one = len(batch) == 1
    # A failed statement would abort the caller's transaction with it: inside one, no first try.
    if isinstance(db, asyncpg.Pool) or not db.is_in_transaction():
        try:
            rows = await db.fetch(
                _ENQUEUE_NEW_ONE if one else _ENQUEUE_NEW_MANY,
                *(_one_arguments(*batch[0]) if one else _many_arguments(batch)),
            )
            return Enqueued({}, True, {row["id"]: row["reason"] for row in rows})
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != PRIMARY_KEY:
                raise
    # The statement that decides takes no handoff: some recipients are not queued at all.
    plain = [(q, dataclasses.replace(e, handoff=None)) for q, e in batch]
    found: dict[uuid.UUID, Duplicates] = {}
    for row in await db.fetch(
        _ENQUEUE_ONE if one else _ENQUEUE_MANY,
        *(_one_arguments(*plain[0], deciding=True) if one else _many_arguments(plain, True)),
    ):
        queue_id = row["message_id"]
        duplicates = found.setdefault(queue_id, Duplicates({}, row["reply_id"]))
        duplicates.originals[row["address"]] = row["original_id"]
    return Enqueued(found, False, {})


def _one_arguments(queue_id: uuid.UUID, e: Envelope, *, deciding: bool = False) -> list[object]:
    """The arguments of _ENQUEUE_NEW_ONE, or of _ENQUEUE_ONE (`deciding`)."""
    values = {
        **store_queue.one_values(queue_id, e),
        "message_key": message_key(e.header_message_id or ""),
        "window": float(e.duplicate_window),
        "content_key": e.content_key,
    }
    return store_queue.arguments(values, _ONE_PARAMETERS if deciding else _NEW_ONE_PARAMETERS)


def _many_arguments(
    batch: Sequence[tuple[uuid.UUID, Envelope]], deciding: bool = False
) -> list[object]:
    """The arguments of _ENQUEUE_NEW_MANY, or of _ENQUEUE_MANY (`deciding`)."""
    values = {
        **store_queue.many_values(batch),
        "message_key": [
            message_key(e.header_message_id or "") if _checked(e) else None for _q, e in batch
        ],
        "window": [float(e.duplicate_window) for _q, e in batch],
        "content_key": [e.content_key for _q, e in batch],
    }
    return store_queue.arguments(values, _MANY_PARAMETERS if deciding else _NEW_MANY_PARAMETERS)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class DuplicateRecord:
    """A recipient a submission named again within the window, and that was not queued again."""

    org_id: uuid.UUID
    original_id: uuid.UUID  # the message that holds the recipient
    reply_id: uuid.UUID  # the queue id the client was answered
    header_message_id: str
    sender: str
    address: str
    received_at: datetime
    listener: str
    client_ip: str | None
    client_helo: str | None
    auth_user: str | None
    size: int
    tls_version: str | None
    tls_cipher: str | None


_OF_MESSAGES = """
SELECT org_id, original_id, reply_id, header_message_id, sender, address, received_at,
       listener, host(client_ip) AS client_ip, client_helo, auth_user, size, tls_version,
       tls_cipher
FROM duplicate_reception WHERE original_id = ANY ($1::uuid[])
ORDER BY received_at, address COLLATE "C"  -- code point order, as Python sorts
"""


async def duplicates_of(db: Executor, queue_ids: Sequence[uuid.UUID]) -> list[DuplicateRecord]:
    """The duplicate receptions of these messages (by the message that holds each recipient),
    oldest first."""
    return [DuplicateRecord(**dict(r)) for r in await db.fetch(_OF_MESSAGES, list(queue_ids))]


# ---------------------------------------------------------------- pruning

# Bounded per call, like the retention purge; a sweep round deletes at most `limit` of each.
_PRUNE_ENTRIES = """
DELETE FROM submission_dedup WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM submission_dedup WHERE expires_at <= now() LIMIT $1))
"""

# The records go with the messages of their age (retention.messages); ids are UUIDv7, so "before
# the cutoff" is a range of the primary key, as in store.queue.purge_finished_messages.
_PRUNE_RECORDS = """
DELETE FROM duplicate_reception WHERE id = ANY (ARRAY (
    SELECT id FROM duplicate_reception
    WHERE id < $1 AND received_at < now() - make_interval(secs => $2)
    ORDER BY id LIMIT $3))
"""


@dataclass(frozen=True)
class Pruned:
    entries: int  # duplicate-window entries whose window had ended
    records: int  # duplicate receptions older than the retention


async def prune(db: Executor, *, keep_records: float, limit: int = 100_000) -> Pruned:
    """Delete up to `limit` entries whose window has ended, and, with `keep_records` > 0, up to
    `limit` duplicate receptions received more than `keep_records` seconds ago."""
    entries = _count(await db.execute(_PRUNE_ENTRIES, limit))
    records = 0
    if keep_records > 0:
        cutoff = id_floor(time.time() - keep_records)
        records = _count(await db.execute(_PRUNE_RECORDS, cutoff, float(keep_records), limit))
    return Pruned(entries, records)


def _count(command_tag: str) -> int:
    return int(command_tag.rsplit(" ", 1)[-1])
