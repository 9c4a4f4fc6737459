"""The queue's intake: enqueue messages with their recipients, and read a message's recipients back.

The message row and its recipients' queue state are written in one statement (one commit), so an
accepted message is never half-queued. Claiming is store/leases.py's, recording store/outcomes.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pigeon_mta.ids import new_id, new_ids
from pigeon_mta.model import Envelope
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.leases import SUPPRESSION_ACTIVE

NOTIFY_CHANNEL = "pigeon_queue"


def recipient_domain(address: str) -> str:
    """The routing domain of an address: what follows the last '@', lower-cased."""
    return address.rpartition("@")[2].lower()


# ---------------------------------------------------------------- enqueue

# Messages, each with all its recipients, in one statement, so in one commit: all of them or none.
# (Data-modifying CTEs run whether or not the final SELECT reads them.) A lone message, the common
# case (group commits form only when commits are already busy), has a statement of its own with
# plain parameters: the array form costs it 10-25% of the enqueue rate (bench/README.md, "Queue").
# `before`: CTEs written in the same statement (store/duplicates.py's entries), each ending in ", ".
_ENQUEUE_ONE_TEMPLATE = """
WITH {before}m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher, lane)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8::inet, $9, $10, $11,
            COALESCE($15::timestamptz, now()), $16, $17, $18)
    RETURNING id, org_id, received_at, lane
), r AS (
    INSERT INTO recipient AS t (id, message_id, org_id, address, domain, created_at,
                                next_attempt_at, lane, status, attempts, lease_owner, lease_until)
    SELECT u.id, m.id, m.org_id, u.address, u.domain, m.received_at, m.received_at, m.lane,
           CASE WHEN $19::text IS NULL THEN 'queued' ELSE 'delivering' END,
           CASE WHEN $19::text IS NULL THEN 0 ELSE 1 END,
           $19::text, now() + make_interval(secs => $20::float8)
    FROM m, unnest($12::uuid[], $13::text[], $14::text[]) AS u (id, address, domain)
    RETURNING t.id, t.org_id, t.address, t.lease_owner
)
SELECT {final}
"""
_ENQUEUE_MANY_TEMPLATE = """
WITH {before}m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher, lane)
    SELECT u.id, u.org_id, u.sender, u.header_message_id, u.size, u.body, u.listener,
           u.client_ip, u.client_helo, u.credential_id, u.auth_user,
           COALESCE(u.received_at, now()), u.tls_version, u.tls_cipher, u.lane
    FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::int[], $6::bytea[],
                $7::text[], $8::inet[], $9::text[], $10::uuid[], $11::text[],
                $16::timestamptz[], $17::text[], $18::text[], $19::text[])
         AS u (id, org_id, sender, header_message_id, size, body, listener, client_ip,
               client_helo, credential_id, auth_user, received_at, tls_version, tls_cipher,
               lane)
    RETURNING id, org_id, received_at, lane
), r AS (
    INSERT INTO recipient AS t (id, message_id, org_id, address, domain, created_at,
                                next_attempt_at, lane, status, attempts, lease_owner, lease_until)
    SELECT u.id, m.id, m.org_id, u.address, u.domain, m.received_at, m.received_at, m.lane,
           CASE WHEN u.lease_owner IS NULL THEN 'queued' ELSE 'delivering' END,
           CASE WHEN u.lease_owner IS NULL THEN 0 ELSE 1 END,
           u.lease_owner, now() + make_interval(secs => u.lease)
    FROM unnest($12::uuid[], $13::uuid[], $14::text[], $15::text[], $20::text[], $21::float8[])
         AS u (id, message_id, address, domain, lease_owner, lease)
    JOIN m ON m.id = u.message_id
    RETURNING t.id, t.org_id, t.address, t.lease_owner
)
SELECT {final}
"""
_NOTIFY = f"pg_notify('{NOTIFY_CHANNEL}', '')"
# The quiet enqueue answers with the handed-off recipients (model.Handoff) that the org's
# suppression list holds: their engine, which does not claim them, learns it here, where a claim
# would have read the list (store/leases.py). One index probe per handed-off recipient.
_SUPPRESSED_HANDOFFS = f"""r.id, s.reason
FROM r JOIN suppression s ON s.org_id = r.org_id AND s.address = lower(r.address)
                          AND {SUPPRESSION_ACTIVE}
WHERE r.lease_owner IS NOT NULL"""
_ENQUEUE_ONE = _ENQUEUE_ONE_TEMPLATE.format(before="", final=_NOTIFY)
_ENQUEUE_ONE_QUIET = _ENQUEUE_ONE_TEMPLATE.format(before="", final=_SUPPRESSED_HANDOFFS)
_ENQUEUE_MANY = _ENQUEUE_MANY_TEMPLATE.format(before="", final=_NOTIFY)
_ENQUEUE_MANY_QUIET = _ENQUEUE_MANY_TEMPLATE.format(before="", final=_SUPPRESSED_HANDOFFS)


def enqueue_statement(*, many: bool, before: str) -> str:
    """The quiet enqueue of one message (parameters as `enqueue_many` passes them, $1-$20) or of
    several (`batch_columns`, $1-$21), with `before` written in the same statement; it returns
    the suppressed handed-off recipients (id, reason)."""
    return (_ENQUEUE_MANY_TEMPLATE if many else _ENQUEUE_ONE_TEMPLATE).format(
        before=before, final=_SUPPRESSED_HANDOFFS
    )


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
) -> dict[uuid.UUID, str]:
    """Queue several messages (queue id, envelope) in one statement: all of them or none.

    With `notify`, the NOTIFY is part of the same transaction, so PostgreSQL delivers it only on
    commit: a worker woken by it always finds the rows (DSNs queued in the record transaction use
    this). But a transaction that NOTIFYs holds PostgreSQL's notification-queue lock from
    pre-commit until its commit record is flushed, so such transactions cannot share a WAL flush
    (group commit): measured here, 16 connections enqueue barely faster than one. The submission
    path (store/group_commit.py) therefore commits without it and wakes the engines afterwards
    through a `NotifySender`, which coalesces wake-ups (store/notify.py).

    Messages with a `handoff` are queued claimed by its engine (model.Handoff); returns, by
    recipient id, the reason of each of their recipients on the org's suppression list.
    """
    if not batch:
        return {}
    for _queue_id, envelope in batch:
        if not envelope.recipients:
            raise ValueError("a message needs at least one recipient")
        if envelope.duplicate_window and envelope.header_message_id:
            raise ValueError("a message checked for duplicates is queued by store.duplicates")
        if notify and envelope.handoff is not None:
            raise ValueError("a handed-off message wakes no engine")
    if notify:
        if len(batch) == 1:
            await db.execute(_ENQUEUE_ONE, *one_columns(*batch[0]))
        else:
            await db.execute(_ENQUEUE_MANY, *batch_columns(batch))
        return {}
    if len(batch) == 1:
        rows = await db.fetch(_ENQUEUE_ONE_QUIET, *one_columns(*batch[0]))
    else:
        rows = await db.fetch(_ENQUEUE_MANY_QUIET, *batch_columns(batch))
    return {row["id"]: row["reason"] for row in rows}


def recipient_ids(e: Envelope) -> Sequence[uuid.UUID]:
    """The ids its recipient rows get: the envelope's, or new ones."""
    if not e.recipient_ids:
        return new_ids(len(e.recipients))
    if len(e.recipient_ids) != len(e.recipients):
        raise ValueError("a message names one id per recipient, or none")
    return e.recipient_ids


def one_columns(queue_id: uuid.UUID, e: Envelope) -> list[object]:
    """The parameters of the lone-message enqueue ($1-$20)."""
    return [
        queue_id,
        e.org_id,
        e.sender,
        e.header_message_id,
        len(e.body),
        e.body,
        e.listener,
        e.client_ip,
        e.client_helo,
        e.credential_id,
        e.auth_user,
        list(recipient_ids(e)),
        list(e.recipients),
        [recipient_domain(r) for r in e.recipients],
        e.received_at,
        e.tls_version,
        e.tls_cipher,
        e.lane,
        e.handoff.owner if e.handoff else None,
        e.handoff.lease if e.handoff else None,
    ]


def batch_columns(batch: Sequence[tuple[uuid.UUID, Envelope]]) -> list[Sequence[object]]:
    """The parameters $1-$21 of _ENQUEUE_MANY (and of the duplicate check's batch statement): one
    array per column, one element per message, but $12-$15, $20 and $21, one element per
    recipient."""
    recipients = [(q, r) for q, envelope in batch for r in envelope.recipients]
    handoffs = [e.handoff for _q, e in batch for _r in e.recipients]
    return [
        [q for q, _e in batch],
        [e.org_id for _q, e in batch],
        [e.sender for _q, e in batch],
        [e.header_message_id for _q, e in batch],
        [len(e.body) for _q, e in batch],
        [e.body for _q, e in batch],
        [e.listener for _q, e in batch],
        [e.client_ip for _q, e in batch],
        [e.client_helo for _q, e in batch],
        [e.credential_id for _q, e in batch],
        [e.auth_user for _q, e in batch],
        [i for _q, e in batch for i in recipient_ids(e)],
        [q for q, _r in recipients],
        [r for _q, r in recipients],
        [recipient_domain(r) for _q, r in recipients],
        [e.received_at for _q, e in batch],
        [e.tls_version for _q, e in batch],
        [e.tls_cipher for _q, e in batch],
        [e.lane for _q, e in batch],
        [h.owner if h else None for h in handoffs],
        [h.lease if h else None for h in handoffs],
    ]


# ---------------------------------------------------------------- read back


async def queued_recipients(
    db: Executor, org_id: uuid.UUID, queue_id: uuid.UUID
) -> tuple[str | None, list[tuple[uuid.UUID, str]]] | None:
    """The Message-ID header value of the org's message `queue_id` and its recipients (id,
    address), ordered by id; None when the org has no such message."""
    rows = await db.fetch(
        """SELECT m.header_message_id, r.id, r.address
           FROM message m JOIN recipient r ON r.message_id = m.id
           WHERE m.id = $1 AND m.org_id = $2
           ORDER BY r.id""",
        queue_id,
        org_id,
    )
    if not rows:
        return None
    return rows[0]["header_message_id"], [(r["id"], r["address"]) for r in rows]
