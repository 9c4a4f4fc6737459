"""The queue: enqueue, claim, record, renew, release, sweep, expire, stats.

The message row and its recipients' queue state are written in one statement (one commit), so an
accepted message is never half-queued. Workers claim due recipients with FOR UPDATE SKIP LOCKED
under a lease; the claim increments `attempts`, which then serves as a fencing token: an outcome is
applied only while the row is still `delivering` with the attempt number of that claim, so a worker
whose lease ran out cannot overwrite the work of the claim that replaced it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id, new_ids
from pigeon_mta.model import (
    AttemptResult,
    ClaimedRecipient,
    Delivery,
    Envelope,
    Outcome,
    Reply,
    Status,
    storable_text,
)

Executor = asyncpg.Pool | asyncpg.Connection

NOTIFY_CHANNEL = "pigeon_queue"


def recipient_domain(address: str) -> str:
    """The routing domain of an address: what follows the last '@', lower-cased."""
    return address.rpartition("@")[2].lower()


# ---------------------------------------------------------------- enqueue

# Messages, each with all its recipients, in one statement, so in one commit: all of them or none.
# (Data-modifying CTEs run whether or not the final SELECT reads them.) A lone message, the common
# case (group commits form only when commits are already busy), has a statement of its own with
# plain parameters: the array form costs it 10-25% of the enqueue rate (bench/README.md, "Queue").
_ENQUEUE_ONE_TEMPLATE = """
WITH m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8::inet, $9, $10, $11,
            COALESCE($15::timestamptz, now()), $16, $17)
    RETURNING id, org_id, received_at
), r AS (
    INSERT INTO recipient (id, message_id, org_id, address, domain, created_at, next_attempt_at)
    SELECT u.id, m.id, m.org_id, u.address, u.domain, m.received_at, m.received_at
    FROM m, unnest($12::uuid[], $13::text[], $14::text[]) AS u (id, address, domain)
)
SELECT {final}
"""
_ENQUEUE_MANY_TEMPLATE = """
WITH m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher)
    SELECT u.id, u.org_id, u.sender, u.header_message_id, u.size, u.body, u.listener,
           u.client_ip, u.client_helo, u.credential_id, u.auth_user,
           COALESCE(u.received_at, now()), u.tls_version, u.tls_cipher
    FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::int[], $6::bytea[],
                $7::text[], $8::inet[], $9::text[], $10::uuid[], $11::text[],
                $16::timestamptz[], $17::text[], $18::text[])
         AS u (id, org_id, sender, header_message_id, size, body, listener, client_ip,
               client_helo, credential_id, auth_user, received_at, tls_version, tls_cipher)
    RETURNING id, org_id, received_at
), r AS (
    INSERT INTO recipient (id, message_id, org_id, address, domain, created_at, next_attempt_at)
    SELECT u.id, m.id, m.org_id, u.address, u.domain, m.received_at, m.received_at
    FROM unnest($12::uuid[], $13::uuid[], $14::text[], $15::text[])
         AS u (id, message_id, address, domain)
    JOIN m ON m.id = u.message_id
)
SELECT {final}
"""
_NOTIFY = f"pg_notify('{NOTIFY_CHANNEL}', '')"
_ENQUEUE_ONE = _ENQUEUE_ONE_TEMPLATE.format(final=_NOTIFY)
_ENQUEUE_ONE_QUIET = _ENQUEUE_ONE_TEMPLATE.format(final="1")
_ENQUEUE_MANY = _ENQUEUE_MANY_TEMPLATE.format(final=_NOTIFY)
_ENQUEUE_MANY_QUIET = _ENQUEUE_MANY_TEMPLATE.format(final="1")


async def enqueue(
    db: Executor,
    envelope: Envelope,
    *,
    notify: bool = True,
    queue_id: uuid.UUID | None = None,
) -> uuid.UUID:
    """Queue one message and all its recipients (see `enqueue_many`); returns the queue id.
    `queue_id` lets the caller name the message beforehand."""
    queue_id = queue_id or new_id()
    await enqueue_many(db, [(queue_id, envelope)], notify=notify)
    return queue_id


async def enqueue_many(
    db: Executor, batch: Sequence[tuple[uuid.UUID, Envelope]], *, notify: bool = False
) -> None:
    """Queue several messages (queue id, envelope) in one statement: all of them or none.

    With `notify`, the NOTIFY is part of the same transaction, so PostgreSQL delivers it only on
    commit: a worker woken by it always finds the rows (DSNs queued in the record transaction use
    this). But a transaction that NOTIFYs holds PostgreSQL's notification-queue lock from
    pre-commit until its commit record is flushed, so such transactions cannot share a WAL flush
    (group commit): measured here, 16 connections enqueue barely faster than one. The submission
    path (store/group_commit.py) therefore commits without it and wakes the engines afterwards
    through a `NotifySender`, which coalesces wake-ups (store/notify.py).
    """
    if not batch:
        return
    for _queue_id, envelope in batch:
        if not envelope.recipients:
            raise ValueError("a message needs at least one recipient")
        if envelope.duplicate_window and envelope.message_id:
            raise ValueError("a message checked for duplicates is queued by store.duplicates")
    if len(batch) == 1:
        queue_id, e = batch[0]
        await db.execute(
            _ENQUEUE_ONE if notify else _ENQUEUE_ONE_QUIET,
            queue_id,
            e.org_id,
            e.sender,
            e.message_id,
            len(e.body),
            e.body,
            e.listener,
            e.client_ip,
            e.client_helo,
            e.credential_id,
            e.auth_user,
            new_ids(len(e.recipients)),
            list(e.recipients),
            [recipient_domain(r) for r in e.recipients],
            e.received_at,
            e.tls_version,
            e.tls_cipher,
        )
        return
    recipients = [(q, r) for q, envelope in batch for r in envelope.recipients]
    await db.execute(
        _ENQUEUE_MANY if notify else _ENQUEUE_MANY_QUIET,
        [q for q, _e in batch],
        [e.org_id for _q, e in batch],
        [e.sender for _q, e in batch],
        [e.message_id for _q, e in batch],
        [len(e.body) for _q, e in batch],
        [e.body for _q, e in batch],
        [e.listener for _q, e in batch],
        [e.client_ip for _q, e in batch],
        [e.client_helo for _q, e in batch],
        [e.credential_id for _q, e in batch],
        [e.auth_user for _q, e in batch],
        new_ids(len(recipients)),
        [q for q, _r in recipients],
        [r for _q, r in recipients],
        [recipient_domain(r) for _q, r in recipients],
        [e.received_at for _q, e in batch],
        [e.tls_version for _q, e in batch],
        [e.tls_cipher for _q, e in batch],
    )


# ---------------------------------------------------------------- claim

# A suppression-list entry `s` in force: the claim reads the list (below), and so does
# store/suppression.py, which owns it.
SUPPRESSION_ACTIVE = "(s.expires_at IS NULL OR s.expires_at > now())"

# Cross-tenant by design: the claim serves every org's queue. ARRAY(...) makes the locking subquery
# run once; the partial index recipient_due serves its WHERE and ORDER BY. One row per recipient,
# grouped in Python: grouping in SQL (array_agg ... ORDER BY per column and group) cost PostgreSQL
# about a seventh of the claim (bench/README.md "Queue").
_CLAIM = f"""
WITH c AS (
    UPDATE recipient r
    SET status = 'delivering',
        lease_until = now() + make_interval(secs => $1),
        lease_owner = $2,
        attempts = r.attempts + 1,
        updated_at = now()
    WHERE r.id = ANY (ARRAY (
        SELECT id FROM recipient
        WHERE status = 'queued' AND next_attempt_at <= now()
        ORDER BY next_attempt_at
        LIMIT $3
        FOR UPDATE SKIP LOCKED))
    RETURNING r.id, r.message_id, r.domain, r.address, r.attempts, r.created_at, r.last_code,
              r.last_enhanced_code, r.last_response
)
SELECT m.id AS message_id, m.org_id, m.sender, m.header_message_id, m.received_at, c.domain,
       c.id, c.address, c.attempts, c.created_at, c.last_code, c.last_enhanced_code,
       c.last_response,
       -- Each body once, on one row of its message, however many recipients and destination
       -- domains it has (a large message to a hundred recipients is read and sent once).
       CASE WHEN row_number() OVER (PARTITION BY m.id) = 1 THEN m.body END AS body,
       -- The org's suppression list, read by the claim itself (one statement less per round;
       -- if it cannot be read, nothing is claimed). Addresses compare as the list stores them.
       s.reason AS suppressed
FROM c JOIN message m ON m.id = c.message_id
LEFT JOIN suppression s ON s.org_id = m.org_id AND s.address = lower(c.address)
                       AND {SUPPRESSION_ACTIVE}
"""


async def claim_due_recipients(
    db: Executor, *, owner: str, lease: float, batch: int
) -> list[Delivery]:
    """Claim up to `batch` due recipients, grouped into one Delivery per (message, domain), in
    the order the messages were received, each one's recipients in address (code point) order."""
    rows = await db.fetch(_CLAIM, float(lease), owner, batch)
    bodies: dict[uuid.UUID, bytes] = {}
    groups: dict[tuple[uuid.UUID, str], list[asyncpg.Record]] = {}
    for row in rows:
        if row["body"] is not None:
            bodies[row["message_id"]] = row["body"]
        groups.setdefault((row["message_id"], row["domain"]), []).append(row)
    deliveries = []
    for (message_id, domain), members in groups.items():
        members.sort(key=lambda row: row["address"])
        first = members[0]
        deliveries.append(
            Delivery(
                message_id=message_id,
                org_id=first["org_id"],
                sender=first["sender"],
                domain=domain,
                header_message_id=first["header_message_id"],
                received_at=first["received_at"],
                body=bodies[message_id],
                recipients=tuple(
                    ClaimedRecipient(
                        id=r["id"],
                        address=r["address"],
                        attempts=r["attempts"],
                        queued_at=r["created_at"],
                        suppressed=r["suppressed"],
                        last_reply=_last_reply(r),
                    )
                    for r in members
                ),
            )
        )
    deliveries.sort(key=lambda d: (d.received_at, d.message_id))
    return deliveries


def _last_reply(row: asyncpg.Record) -> Reply | None:
    """The reply a recipient's previous attempt recorded (a local failure's code 0 is NULL)."""
    if row["last_response"] is None:
        return None
    return Reply(row["last_code"] or 0, row["last_enhanced_code"], row["last_response"])


# ---------------------------------------------------------------- record

# One statement: the recipient rows move (only where the claim still holds, see module doc) and the
# attempt rows are appended, each saying whether its outcome was applied.
_RECORD = """
WITH v AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::int[], $6::text[],
                         $7::timestamptz[], $8::float8[], $9::timestamptz[], $10::text[],
                         $11::text[], $12::int[], $13::text[], $14::text[], $15::int[],
                         $16::text[], $17::text[], $18::text[], $19::text[], $20::text[])
        AS v (attempt_id, recipient_id, message_id, org_id, attempt, outcome,
              started_at, duration, next_attempt_at, mx_host,
              ip, port, tls_version, tls_cipher, code,
              enhanced_code, response, category, rule, dkim)
), u AS (
    UPDATE recipient r
    SET status = CASE v.outcome WHEN 'deferred' THEN 'queued' ELSE v.outcome END,
        next_attempt_at = COALESCE(v.next_attempt_at, r.next_attempt_at),
        lease_until = NULL,
        lease_owner = NULL,
        last_code = v.code,
        last_enhanced_code = v.enhanced_code,
        last_response = v.response,
        updated_at = now()
    FROM v
    WHERE r.id = v.recipient_id AND r.status = 'delivering' AND r.attempts = v.attempt
    RETURNING r.id, r.attempts
), a AS (
    INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, duration_ms,
                         mx_host, ip, port, tls_version, tls_cipher, code, enhanced_code, response,
                         outcome, category, rule, next_attempt_at, applied, dkim)
    SELECT v.attempt_id, v.recipient_id, v.message_id, v.org_id, v.attempt, v.started_at,
           v.duration * 1000, v.mx_host, v.ip, v.port, v.tls_version, v.tls_cipher, v.code,
           v.enhanced_code, v.response, v.outcome, v.category, v.rule, v.next_attempt_at,
           u.id IS NOT NULL, v.dkim
    -- By claim, not by row: a stale outcome of a recipient that a newer claim in the same batch
    -- moved is still not applied.
    FROM v LEFT JOIN u ON u.id = v.recipient_id AND u.attempts = v.attempt
    RETURNING recipient_id, attempt, applied
)
-- Only the exceptions travel back (normally none): one row per outcome was 100 rows to decode.
SELECT recipient_id, attempt FROM a WHERE NOT applied
"""


async def record_attempts(db: Executor, results: Sequence[AttemptResult]) -> set[uuid.UUID]:
    """Record a batch of outcomes in one statement; returns the recipient ids whose state moved.

    A result whose claim no longer holds is still written to the attempt log (applied = false), so
    a delivery made after a lease ran out shows up as a possible duplicate instead of vanishing.
    """
    if not results:
        return set()
    for result in results:
        if result.outcome == Outcome.DEFERRED and result.next_attempt_at is None:
            raise ValueError("a deferred outcome needs next_attempt_at")
    not_applied = {
        (row["recipient_id"], row["attempt"])
        for row in await db.fetch(_RECORD, *_record_arguments(results))
    }
    return {r.recipient_id for r in results if (r.recipient_id, r.attempt) not in not_applied}


def _record_arguments(results: Sequence[AttemptResult]) -> list[Sequence[object]]:
    """The parameters of _RECORD: one array per column, one element per result."""
    return [
        new_ids(len(results)),
        [r.recipient_id for r in results],
        [r.message_id for r in results],
        [r.org_id for r in results],
        [r.attempt for r in results],
        [str(r.outcome) for r in results],
        [r.started_at for r in results],
        [r.duration for r in results],
        [r.next_attempt_at for r in results],
        [storable_text(r.mx_host) for r in results],
        [storable_text(r.ip) for r in results],
        [r.port for r in results],
        [storable_text(r.tls_version) for r in results],
        [storable_text(r.tls_cipher) for r in results],
        [r.reply.code or None for r in results],
        [storable_text(r.reply.enhanced_code) for r in results],
        [storable_text(r.reply.text) for r in results],
        [storable_text(r.category) for r in results],
        [storable_text(r.rule) for r in results],
        [storable_text(r.dkim) for r in results],
    ]


# ---------------------------------------------------------------- leases

# A lease is named by its row AND the claim's attempt number: processes of one node share its name
# as lease owner, so the name alone cannot tell a claim from a newer claim of the same row (taken
# after the first one's lease ran out).
_RENEW_FENCED = """
UPDATE recipient r SET lease_until = now() + make_interval(secs => $3), updated_at = now()
FROM unnest($1::uuid[], $4::int[]) AS v (id, attempt)
WHERE r.id = v.id AND r.attempts = v.attempt AND r.status = 'delivering' AND r.lease_owner = $2
"""


async def renew_leases(
    db: Executor,
    ids: Sequence[uuid.UUID],
    *,
    owner: str,
    lease: float,
    attempts: Sequence[int],
) -> int:
    """Extend the lease of these very claims (ids with their attempt numbers) while `owner` still
    holds them: a long transaction keeps its claim."""
    return _count(await db.execute(_RENEW_FENCED, list(ids), owner, float(lease), list(attempts)))


# Undo a claim that was never attempted (graceful shutdown): the attempt did not happen, so the
# counter goes back down and the row is due again at once.
_RELEASE_FENCED = """
UPDATE recipient r
SET status = 'queued', attempts = r.attempts - 1, lease_until = NULL, lease_owner = NULL,
    next_attempt_at = COALESCE($4, r.next_attempt_at), updated_at = now()
FROM unnest($1::uuid[], $3::int[]) AS v (id, attempt)
WHERE r.id = v.id AND r.attempts = v.attempt AND r.status = 'delivering' AND r.lease_owner = $2
"""


async def release_leases(
    db: Executor,
    ids: Sequence[uuid.UUID],
    *,
    owner: str,
    attempts: Sequence[int],
    due_at: datetime | None = None,
) -> int:
    """Undo these very claims, never attempted (see _RENEW_FENCED): the attempt counter goes back
    down and the rows are due again at once, or at `due_at` (a destination with no room now, its
    rate or concurrency limit, gets them back when it should have room)."""
    tag = await db.execute(_RELEASE_FENCED, list(ids), owner, list(attempts), due_at)
    return _count(tag)


# A lease that ran out (or that a restarted node held) stands for an attempt whose outcome nobody
# recorded. The row goes back to queued, due at once, and the lost attempt is written to the log:
# the message may or may not have reached the peer.
_REQUEUE_LOST = """
WITH lost AS (
    SELECT id, lease_owner FROM recipient
    WHERE status = 'delivering' AND {condition}
    ORDER BY lease_until
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), q AS (
    UPDATE recipient r
    SET status = 'queued', lease_until = NULL, lease_owner = NULL, updated_at = now(),
        last_code = NULL, last_enhanced_code = NULL,
        last_response = 'lease of ' || lost.lease_owner || ' ended before its attempt was recorded'
    FROM lost WHERE r.id = lost.id
    RETURNING r.id, r.message_id, r.org_id, r.attempts, r.last_response
)
INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, outcome, response)
SELECT {id_function}, q.id, q.message_id, q.org_id, q.attempts, now(), 'deferred',
       q.last_response || '; outcome unknown, delivery will be tried again'
FROM q
RETURNING recipient_id
"""

# Attempt ids made in SQL for these rare rows: a v4 id is fine (time order is only an index nicety).
_SQL_ID = "gen_random_uuid()"

_SWEEP = _REQUEUE_LOST.format(condition="lease_until < now()", id_function=_SQL_ID)
# The leases of a node name's runs that are gone (lease owners are `<node name>/<run id>`). A run
# is live while its row in `node` has it, is not stopped and has a fresh heartbeat (store/nodes.py);
# a lease of a live run is never freed here, whatever its name, since that run may be mid-DATA.
# Owners without a run id (written before runs had one) are left to the sweeper.
# (lease_until IS NOT NULL: the rows in flight, through recipient_leased, not the whole table)
_FREE_GONE_RUNS = _REQUEUE_LOST.format(
    condition="""lease_until IS NOT NULL AND starts_with(lease_owner, $2 || '/')
        AND NOT EXISTS (
            SELECT 1 FROM node n
            WHERE n.name = $2 AND lease_owner = n.name || '/' || n.run_id
              AND n.stopped_at IS NULL
              AND n.heartbeat_at >= now() - make_interval(secs => $3))""",
    id_function=_SQL_ID,
)


async def requeue_expired_leases(db: Executor, *, limit: int = 1000) -> int:
    """Put `delivering` rows whose lease ran out back to queued; returns how many."""
    return len(await db.fetch(_SWEEP, limit))


async def free_leases_of_gone_runs(
    db: Executor, *, node_name: str, stale_after: float, limit: int = 100_000
) -> int:
    """At node start: rows that earlier runs of this node name held when they stopped or died go
    back to queued at once, instead of waiting for their leases to run out. A run whose heartbeat
    is younger than `stale_after` seconds keeps its rows."""
    return len(await db.fetch(_FREE_GONE_RUNS, limit, node_name, float(stale_after)))


# ---------------------------------------------------------------- expiry

# Reads only due rows (through recipient_due): mail that is not due waits for its next attempt,
# where the engine's own max_age check expires it.
_EXPIRE = """
WITH old AS (
    SELECT id FROM recipient
    WHERE status = 'queued' AND next_attempt_at <= now()
      AND created_at < now() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), e AS (
    UPDATE recipient r
    SET status = 'expired', updated_at = now(), lease_until = NULL, lease_owner = NULL
    FROM old WHERE r.id = old.id
    RETURNING r.id, r.message_id, r.org_id, r.attempts, r.last_code, r.last_enhanced_code,
              r.last_response
)
INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, outcome,
                     code, enhanced_code, response, category)
SELECT gen_random_uuid(), e.id, e.message_id, e.org_id, e.attempts, now(), 'expired',
       e.last_code, e.last_enhanced_code,
       'expired after ' || $3 || ' in the queue; last reply: ' || COALESCE(e.last_response, 'none'),
       'expired'
FROM e
RETURNING recipient_id, message_id
"""


@dataclass(frozen=True)
class ExpiredRecipient:
    recipient_id: uuid.UUID
    message_id: uuid.UUID


async def expire_old_recipients(
    db: Executor, *, max_age: float, max_age_text: str, limit: int = 1000
) -> list[ExpiredRecipient]:
    """Due recipients older than max_age become `expired` (with an attempt-log entry)."""
    rows = await db.fetch(_EXPIRE, float(max_age), limit, max_age_text)
    return [ExpiredRecipient(r["recipient_id"], r["message_id"]) for r in rows]


# ---------------------------------------------------------------- retention

# Message ids are UUIDv7, so "received before the cutoff" is a range of the primary key, which
# the index serves; received_at decides, so that a row whose id is not time-ordered (made by hand
# or by another tool) is never purged early. Only messages none of whose recipients is still
# queued or being delivered are purged; recipients go with their message (ON DELETE CASCADE),
# attempts by their recipients' ids (every statement of a WITH sees the rows as they were).
_PURGE = """
WITH old AS (
    SELECT m.id FROM message m
    WHERE m.id < $1
      AND m.received_at < now() - make_interval(secs => $3)
      AND NOT EXISTS (SELECT 1 FROM recipient r
                      WHERE r.message_id = m.id AND r.status IN ('queued', 'delivering'))
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


def id_floor(unix_time: float) -> uuid.UUID:
    """The smallest UUIDv7 made at `unix_time`: every id made earlier sorts below it."""
    millis = max(0, int(unix_time * 1000))
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62))


# ---------------------------------------------------------------- stats


@dataclass(frozen=True)
class QueueStats:
    queued: int  # waiting, due or not
    due: int  # queued and due now
    deferred: int  # queued after at least one attempt
    delivering: int  # claimed, under a lease
    oldest_due_age: float  # seconds the longest-waiting due recipient has waited (0 if none)


# Only the live part of the table is read (partial indexes), so the cost follows the queue depth,
# not the history.
_STATS = """
SELECT
    (SELECT count(*) FROM recipient WHERE status = 'queued') AS queued,
    (SELECT count(*) FROM recipient WHERE status = 'queued' AND next_attempt_at <= now()) AS due,
    (SELECT count(*) FROM recipient WHERE status = 'queued' AND attempts > 0) AS deferred,
    -- the rows in flight (lease_until is set exactly while status = 'delivering', migration 0006)
    (SELECT count(*) FROM recipient WHERE lease_until IS NOT NULL) AS delivering,
    (SELECT COALESCE(extract(epoch FROM now() - min(next_attempt_at)), 0)
       FROM recipient WHERE status = 'queued' AND next_attempt_at <= now()) AS oldest_due_age
"""


async def queue_stats(db: Executor) -> QueueStats:
    row = await db.fetchrow(_STATS)
    assert row is not None
    return QueueStats(
        queued=row["queued"],
        due=row["due"],
        deferred=row["deferred"],
        delivering=row["delivering"],
        oldest_due_age=float(row["oldest_due_age"]),
    )


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class RecipientState:
    id: uuid.UUID
    message_id: uuid.UUID
    address: str
    status: Status
    attempts: int
    next_attempt_at: datetime
    lease_owner: str | None
    last_code: int | None
    last_enhanced_code: str | None
    last_response: str | None


async def recipients_of_message(db: Executor, message_id: uuid.UUID) -> list[RecipientState]:
    rows = await db.fetch(
        """SELECT id, message_id, address, status, attempts, next_attempt_at, lease_owner,
                  last_code, last_enhanced_code, last_response
           FROM recipient WHERE message_id = $1 ORDER BY address""",
        message_id,
    )
    return [
        RecipientState(
            id=r["id"],
            message_id=r["message_id"],
            address=r["address"],
            status=Status(r["status"]),
            attempts=r["attempts"],
            next_attempt_at=r["next_attempt_at"],
            lease_owner=r["lease_owner"],
            last_code=r["last_code"],
            last_enhanced_code=r["last_enhanced_code"],
            last_response=r["last_response"],
        )
        for r in rows
    ]


def _count(command_tag: str) -> int:
    """The row count of an "UPDATE n" / "DELETE n" command tag."""
    return int(command_tag.rsplit(" ", 1)[-1])
