"""The queue's leases: renewal, release, postponement and sweeping of claimed recipients
(store/claims.py claims them).

A lease is fenced by the claim's attempt number (store/claims.py), so a worker whose lease ran out
cannot renew or release the rows of the claim that replaced it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from pigeon_mta.store.executor import Executor

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


# Undo claims that were never attempted: the attempt did not happen, so the counter goes back down.
# Each row is due again at its due_at (NULL: when it was due before, i.e. at once), with the
# reason it waits (a budget without room now, a destination backing off; NULL: none). A row that
# waits for its destination's rate budget joins that site's queue (`site`, migration 0024) and is
# due at once: the site claim takes it when the budget has room. A row already in a site queue
# stays in it. The reason and the site are cleared when an attempt is recorded
# (store/outcomes.py).
_RELEASE_FENCED = """
UPDATE recipient r
SET status = 'queued', attempts = r.attempts - 1, lease_until = NULL, lease_owner = NULL,
    next_attempt_at = CASE WHEN v.site IS NOT NULL THEN now()
                           ELSE COALESCE(v.due_at, r.next_attempt_at) END,
    postponed = v.reason, site = COALESCE(v.site, r.site),
    updated_at = now()
FROM unnest($1::uuid[], $3::int[], $4::timestamptz[], $5::text[], $6::text[])
    AS v (id, attempt, due_at, reason, site)
WHERE r.id = v.id AND r.attempts = v.attempt AND r.status = 'delivering' AND r.lease_owner = $2
"""


async def release_leases(
    db: Executor, ids: Sequence[uuid.UUID], *, owner: str, attempts: Sequence[int]
) -> int:
    """Undo these very claims, never attempted (see _RENEW_FENCED): the attempt counter goes back
    down and the rows are due again at once (graceful shutdown)."""
    none = [None] * len(ids)
    tag = await db.execute(_RELEASE_FENCED, list(ids), owner, list(attempts), none, none, none)
    return _count(tag)


async def postpone_leases(
    db: Executor,
    ids: Sequence[uuid.UUID],
    *,
    owner: str,
    attempts: Sequence[int],
    due_at: Sequence[datetime],
    reasons: Sequence[str | None],
    sites: Sequence[str | None] | None = None,
) -> int:
    """Undo these very claims like `release_leases`, each due at its `due_at`, with the reason
    it waits; a row with a site (a budget key) joins that site's queue instead, due at once."""
    tag = await db.execute(
        _RELEASE_FENCED,
        list(ids),
        owner,
        list(attempts),
        list(due_at),
        list(reasons),
        list(sites) if sites is not None else [None] * len(ids),
    )
    return _count(tag)


# Rows that wait for the same site as a delivery just handed back to it, moved into its queue
# without a claim each: among the first $5 due rows of the delivery's (org, lane) group
# (recipient_due_group), those to the same domain. A backlog to a busy site thus costs each row
# one write to join the queue, not a claim and a hand-back. Rows a claim holds this moment are
# passed over (SKIP LOCKED); the claim that took them hands them back itself. Keyed rows stay:
# the claim's ordering rule (store/claims.py `_IN_ORDER`) must see each before it goes.
_JOIN_SITE = """
WITH m AS (
    SELECT DISTINCT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $6::text[])
        AS m (org_id, lane, domain, site, reason)
), candidate AS (
    SELECT q.id, m.site, m.reason FROM m CROSS JOIN LATERAL (
        SELECT id FROM recipient
        WHERE status = 'queued' AND site IS NULL AND org_id = m.org_id AND lane = m.lane
          AND domain = m.domain AND order_key IS NULL
          AND next_attempt_at <= least(now(), COALESCE((
              SELECT next_attempt_at FROM recipient
              WHERE status = 'queued' AND site IS NULL AND org_id = m.org_id AND lane = m.lane
              ORDER BY next_attempt_at OFFSET $5 LIMIT 1), now()))
        ORDER BY next_attempt_at LIMIT $5
        FOR UPDATE SKIP LOCKED) q
)
UPDATE recipient r SET site = c.site, postponed = c.reason, updated_at = now()
FROM candidate c WHERE r.id = c.id
"""

# How many of a group's due rows one move looks at.
JOIN_SITE_SCAN = 5000


async def join_site_queues(
    db: Executor,
    groups: Sequence[tuple[uuid.UUID, str, str, str, str | None]],
    *,
    scan: int = JOIN_SITE_SCAN,
) -> int:
    """Move the due rows of each (org, lane, domain) into the queue of the site named with it
    (with the reason they wait), as `_JOIN_SITE` says; returns how many moved."""
    if not groups:
        return 0
    columns = list(zip(*groups, strict=True))
    tag = await db.execute(
        _JOIN_SITE,
        list(columns[0]),
        list(columns[1]),
        list(columns[2]),
        list(columns[3]),
        scan,
        list(columns[4]),
    )
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


def _count(command_tag: str) -> int:
    """The row count of an "UPDATE n" / "DELETE n" command tag."""
    return int(command_tag.rsplit(" ", 1)[-1])
