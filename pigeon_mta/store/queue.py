"""The queue's intake: enqueue messages with their recipients, and read a message's recipients back.

The message row and its recipients' queue state are written in one statement (one commit), so an
accepted message is never half-queued. Claiming is store/leases.py's, recording store/outcomes.py's.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

from pigeon_mta.domains import routing_domain
from pigeon_mta.ids import new_id, new_ids
from pigeon_mta.model import Envelope
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.suppression import SUPPRESSION_ACTIVE

NOTIFY_CHANNEL = "pigeon_queue"


def recipient_domain(address: str) -> str:
    """The routing domain of an address: what follows the last '@', in the one spelling of
    domains.py (lower case, A-labels), so that an IDN recipient is grouped under the name it is
    routed by (`domains.routing_domain`)."""
    return routing_domain(address.rpartition("@")[2])


# ---------------------------------------------------------------- enqueue

# Messages, each with all its recipients, in one statement, so in one commit: all of them or none.
# (Data-modifying CTEs run whether or not the final SELECT reads them.) A lone message, the common
# case (group commits form only when commits are already busy), has a statement of its own with
# plain parameters: the array form costs it 10-25% of the enqueue rate (bench/README.md, "Queue").
# `before`: CTEs written in the same statement (store/duplicates.py's entries), each ending in ", ".
#
# Parameters are named in the statements (:org_id) and numbered by `bind` from the tables below:
# a statement built on these, with parameters of its own after them (store/duplicates.py), names
# them, and a name that is not a parameter of the statement fails at import.
ONE_PARAMETERS = (
    "id", "org_id", "sender", "header_message_id", "size", "body", "listener", "client_ip",
    "client_helo", "credential_id", "auth_user", "recipient_ids", "addresses", "domains",
    "received_at", "tls_version", "tls_cipher", "lane", "lease_owner", "lease", "expires_at",
    "send_at", "order_key", "metadata",
)  # fmt: skip
# Of a batch: one array per parameter, one element per message, but recipient_ids,
# recipient_queue_ids, addresses, domains, lease_owner and lease: one element per recipient.
MANY_PARAMETERS = (
    "id", "org_id", "sender", "header_message_id", "size", "body", "listener", "client_ip",
    "client_helo", "credential_id", "auth_user", "recipient_ids", "recipient_queue_ids",
    "addresses", "domains", "received_at", "tls_version", "tls_cipher", "lane", "lease_owner",
    "lease", "expires_at", "send_at", "order_key", "metadata",
)  # fmt: skip
# What a message queued straight into its process's engine has besides (model.Handoff).
HANDOFF_PARAMETERS = ("lease_owner", "lease")

_PARAMETER = re.compile(r"(?<![:\w]):([a-z_][a-z_0-9]*)")


def bind(sql: str, names: Sequence[str]) -> str:
    """`sql` with each :name numbered by its place in `names` ($1 for the first)."""
    index = {name: i for i, name in enumerate(names, 1)}

    def number(match: re.Match[str]) -> str:
        try:
            return f"${index[match.group(1)]}"
        except KeyError:
            raise ValueError(f"the statement names :{match.group(1)}, not a parameter") from None

    return _PARAMETER.sub(number, sql)


def without_handoff(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(name for name in names if name not in HANDOFF_PARAMETERS)


_ENQUEUE_ONE_TEMPLATE = """
WITH {before}m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher, lane, expires_at, send_at, order_key, metadata)
    VALUES (:id, :org_id, :sender, :header_message_id, :size, :body, :listener, :client_ip::inet, :client_helo, :credential_id, :auth_user,
            COALESCE(:received_at::timestamptz, now()), :tls_version, :tls_cipher, :lane,
            :expires_at::timestamptz, :send_at::timestamptz, :order_key::text, :metadata::jsonb)
    RETURNING id, org_id, COALESCE(send_at, received_at) AS queued_at, lane, order_key,
              received_at
), r AS (
    INSERT INTO recipient AS t (id, message_id, org_id, address, domain, created_at,
                                next_attempt_at, lane, status, attempts, lease_owner, lease_until,
                                order_key, order_at)
    SELECT u.id, m.id, m.org_id, u.address, u.domain, m.queued_at, m.queued_at, m.lane,
           CASE WHEN :lease_owner::text IS NULL THEN 'queued' ELSE 'delivering' END,
           CASE WHEN :lease_owner::text IS NULL THEN 0 ELSE 1 END,
           :lease_owner::text, now() + make_interval(secs => :lease::float8), m.order_key,
           CASE WHEN m.order_key IS NOT NULL THEN m.received_at END
    FROM m, unnest(:recipient_ids::uuid[], :addresses::text[], :domains::text[]) AS u (id, address, domain)
    RETURNING t.id, t.org_id, t.address, t.lease_owner
)
SELECT {final}
"""
_ENQUEUE_MANY_TEMPLATE = """
WITH {before}m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener,
                         client_ip, client_helo, credential_id, auth_user, received_at,
                         tls_version, tls_cipher, lane, expires_at, send_at, order_key, metadata)
    SELECT u.id, u.org_id, u.sender, u.header_message_id, u.size, u.body, u.listener,
           u.client_ip, u.client_helo, u.credential_id, u.auth_user,
           COALESCE(u.received_at, now()), u.tls_version, u.tls_cipher, u.lane,
           u.expires_at, u.send_at, u.order_key, u.metadata
    FROM unnest(:id::uuid[], :org_id::uuid[], :sender::text[], :header_message_id::text[], :size::int[], :body::bytea[],
                :listener::text[], :client_ip::inet[], :client_helo::text[], :credential_id::uuid[], :auth_user::text[],
                :received_at::timestamptz[], :tls_version::text[], :tls_cipher::text[], :lane::text[],
                :expires_at::timestamptz[], :send_at::timestamptz[], :order_key::text[], :metadata::jsonb[])
         AS u (id, org_id, sender, header_message_id, size, body, listener, client_ip,
               client_helo, credential_id, auth_user, received_at, tls_version, tls_cipher,
               lane, expires_at, send_at, order_key, metadata)
    RETURNING id, org_id, COALESCE(send_at, received_at) AS queued_at, lane, order_key,
              received_at
), r AS (
    INSERT INTO recipient AS t (id, message_id, org_id, address, domain, created_at,
                                next_attempt_at, lane, status, attempts, lease_owner, lease_until,
                                order_key, order_at)
    SELECT u.id, m.id, m.org_id, u.address, u.domain, m.queued_at, m.queued_at, m.lane,
           CASE WHEN u.lease_owner IS NULL THEN 'queued' ELSE 'delivering' END,
           CASE WHEN u.lease_owner IS NULL THEN 0 ELSE 1 END,
           u.lease_owner, now() + make_interval(secs => u.lease), m.order_key,
           CASE WHEN m.order_key IS NOT NULL THEN m.received_at END
    FROM unnest(:recipient_ids::uuid[], :recipient_queue_ids::uuid[], :addresses::text[], :domains::text[], :lease_owner::text[], :lease::float8[])
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
_ENQUEUE_ONE = bind(_ENQUEUE_ONE_TEMPLATE.format(before="", final=_NOTIFY), ONE_PARAMETERS)
_ENQUEUE_ONE_QUIET = bind(
    _ENQUEUE_ONE_TEMPLATE.format(before="", final=_SUPPRESSED_HANDOFFS), ONE_PARAMETERS
)
_ENQUEUE_MANY = bind(_ENQUEUE_MANY_TEMPLATE.format(before="", final=_NOTIFY), MANY_PARAMETERS)
_ENQUEUE_MANY_QUIET = bind(
    _ENQUEUE_MANY_TEMPLATE.format(before="", final=_SUPPRESSED_HANDOFFS), MANY_PARAMETERS
)


def enqueue_statement(*, many: bool, before: str, names: Sequence[str]) -> str:
    """The quiet enqueue of one message (ONE_PARAMETERS) or of several (MANY_PARAMETERS), with
    `before` written in the same statement, its parameters numbered by `names` (the enqueue's,
    then the caller's own); it returns the suppressed handed-off recipients (id, reason)."""
    template = _ENQUEUE_MANY_TEMPLATE if many else _ENQUEUE_ONE_TEMPLATE
    return bind(template.format(before=before, final=_SUPPRESSED_HANDOFFS), names)


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
            await db.execute(_ENQUEUE_ONE, *arguments(one_values(*batch[0]), ONE_PARAMETERS))
        else:
            await db.execute(_ENQUEUE_MANY, *arguments(many_values(batch), MANY_PARAMETERS))
        return {}
    if len(batch) == 1:
        rows = await db.fetch(_ENQUEUE_ONE_QUIET, *arguments(one_values(*batch[0]), ONE_PARAMETERS))
    else:
        rows = await db.fetch(_ENQUEUE_MANY_QUIET, *arguments(many_values(batch), MANY_PARAMETERS))
    return {row["id"]: row["reason"] for row in rows}


def recipient_ids(e: Envelope) -> Sequence[uuid.UUID]:
    """The ids its recipient rows get: the envelope's, or new ones."""
    if not e.recipient_ids:
        return new_ids(len(e.recipients))
    if len(e.recipient_ids) != len(e.recipients):
        raise ValueError("a message names one id per recipient, or none")
    return e.recipient_ids


def arguments(values: dict[str, object], names: Sequence[str]) -> list[object]:
    """The arguments of a statement bound with `names`, from the values by name."""
    return [values[name] for name in names]


def one_values(queue_id: uuid.UUID, e: Envelope) -> dict[str, object]:
    """The values of ONE_PARAMETERS for one message."""
    return {
        "id": queue_id,
        "org_id": e.org_id,
        "sender": e.sender,
        "header_message_id": e.header_message_id,
        "size": len(e.body),
        "body": e.body,
        "listener": e.listener,
        "client_ip": e.client_ip,
        "client_helo": e.client_helo,
        "credential_id": e.credential_id,
        "auth_user": e.auth_user,
        "recipient_ids": list(recipient_ids(e)),
        "addresses": list(e.recipients),
        "domains": [recipient_domain(r) for r in e.recipients],
        "received_at": e.received_at,
        "tls_version": e.tls_version,
        "tls_cipher": e.tls_cipher,
        "lane": e.lane,
        "lease_owner": e.handoff.owner if e.handoff else None,
        "lease": e.handoff.lease if e.handoff else None,
        **_intent_values(e),
    }


def many_values(batch: Sequence[tuple[uuid.UUID, Envelope]]) -> dict[str, object]:
    """The values of MANY_PARAMETERS for a batch of messages (queue id, envelope)."""
    recipients = [(q, r) for q, envelope in batch for r in envelope.recipients]
    handoffs = [e.handoff for _q, e in batch for _r in e.recipients]
    return {
        "id": [q for q, _e in batch],
        "org_id": [e.org_id for _q, e in batch],
        "sender": [e.sender for _q, e in batch],
        "header_message_id": [e.header_message_id for _q, e in batch],
        "size": [len(e.body) for _q, e in batch],
        "body": [e.body for _q, e in batch],
        "listener": [e.listener for _q, e in batch],
        "client_ip": [e.client_ip for _q, e in batch],
        "client_helo": [e.client_helo for _q, e in batch],
        "credential_id": [e.credential_id for _q, e in batch],
        "auth_user": [e.auth_user for _q, e in batch],
        "recipient_ids": [i for _q, e in batch for i in recipient_ids(e)],
        "recipient_queue_ids": [q for q, _r in recipients],
        "addresses": [r for _q, r in recipients],
        "domains": [recipient_domain(r) for _q, r in recipients],
        "received_at": [e.received_at for _q, e in batch],
        "tls_version": [e.tls_version for _q, e in batch],
        "tls_cipher": [e.tls_cipher for _q, e in batch],
        "lane": [e.lane for _q, e in batch],
        "lease_owner": [h.owner if h else None for h in handoffs],
        "lease": [h.lease if h else None for h in handoffs],
        "expires_at": [e.expires_at for _q, e in batch],
        "send_at": [e.send_at for _q, e in batch],
        "order_key": [e.order_key for _q, e in batch],
        "metadata": [_metadata(e) for _q, e in batch],
    }


def _intent_values(e: Envelope) -> dict[str, object]:
    return {
        "expires_at": e.expires_at,
        "send_at": e.send_at,
        "order_key": e.order_key,
        "metadata": _metadata(e),
    }


def _metadata(e: Envelope) -> str | None:
    return json.dumps(dict(e.metadata), sort_keys=True) if e.metadata else None


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
