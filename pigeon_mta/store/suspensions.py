"""Suspensions: mail of an org, a lane, a site or a domain that is not attempted until resumed or
until a given time (`pigeon-mta queue suspend|resume`, table `suspension`, migration 0024); and
holds, a site's mail of one org not attempted for the retry delay a reply of that site stated to
that org's mail (kind 'reply', key `hold_key`, migration 0026), which end by themselves.

Both claims pass over the groups of a suspended org or lane (store/leases.py); mail to a
suspended site or domain waits in the queue of that key (`recipient.site`), which the site claim
passes over. The engines hand back, unattempted, whatever they hold when a suspension begins
(they read the suspensions in force every second, outbound/budgets.py). `pigeon-mta log` shows
the suspension on each queued recipient it holds (store/events.py). Cross-tenant by design for
sites, domains and lanes (an operator's tool); an org's suspension is that org's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.store.executor import Executor
from pigeon_mta.store.webhooks import org_event

ORG = "org:"
LANE = "lane:"
DOMAIN = "domain:"
SITE = "destination:"  # a site's budget key (store/budgets.py)

ACTIVE = "(x.until IS NULL OR x.until > now())"

# What a suspension `x` says of the mail it holds (`log`, and the reason engines hand it back with;
# SQL function suspension_note, migration 0026).
NOTE = "suspension_note(x)"

# Who set a suspension: an operator, or a reply that stated a retry delay (`hold`).
OPERATOR = "operator"
REPLY = "reply"


def hold_key(site: str, org_id: object) -> str:
    """The key of a site held for one org (its mail waits in the queue of that key)."""
    return f"{site}|{ORG}{org_id}"


# Mail to a suspended domain waits in the domain's queue, out of the claims' way; at resume it
# goes back to the general claim. (Mail of a suspended org or lane stays where it is: the claims
# pass over it. Mail to a suspended site joins the site's queue when an engine next routes it.)
_TO_DOMAIN_QUEUE = """
UPDATE recipient SET site = $2, updated_at = now()
WHERE status = 'queued' AND domain = $1 AND site IS NULL
"""
_FROM_DOMAIN_QUEUE = """
UPDATE recipient SET site = NULL, updated_at = now() WHERE status = 'queued' AND site = $1
"""


# The org's webhook event when an operator pauses or resumes it (a reputation pause writes its own,
# store/reputation.py). A suspension with an end ends without one.
_ORG_EVENT = org_event()


@dataclass(frozen=True)
class Suspension:
    key: str
    until: datetime | None
    reason: str
    created_at: datetime
    waiting: int  # queued recipients it holds
    kind: str = OPERATOR  # or REPLY: a site held for one org after a stated retry delay


async def suspend(
    conn: asyncpg.Connection, key: str, *, reason: str, seconds: float | None
) -> None:
    """Suspend `key` (replacing a suspension of it in force) for `seconds` (None: until
    resumed)."""
    async with conn.transaction():
        await conn.execute(
            """INSERT INTO suspension (key, until, reason) VALUES
                   ($1, CASE WHEN $2::float8 IS NULL THEN NULL
                             ELSE now() + make_interval(secs => $2::float8) END, $3)
               ON CONFLICT (key) DO UPDATE
               SET until = excluded.until, reason = excluded.reason, created_at = now(),
                   kind = excluded.kind""",
            key,
            seconds,
            reason,
        )
        if key.startswith(DOMAIN):
            await conn.execute(_TO_DOMAIN_QUEUE, key.removeprefix(DOMAIN), key)
        elif key.startswith(ORG):
            data = {"reason": reason, "by": OPERATOR, "for_seconds": seconds}
            org_id = uuid.UUID(key.removeprefix(ORG))
            await conn.execute(_ORG_EVENT, org_id, "paused", json.dumps(data))


async def hold(db: Executor, holds: dict[str, tuple[float, str]]) -> None:
    """Suspensions a reply asked for (kind 'reply'): sites held for orgs (`hold_key`) for the
    seconds the reply stated, or sites for every org (a reply rule's), each {key: (seconds,
    reason)}. One in force is only ever lengthened; an operator's of the same key stands while
    in force, and one until resumed (whoever wrote it) is never made one that ends."""
    if not holds:
        return
    keys = sorted(holds)
    await db.execute(
        f"""INSERT INTO suspension AS x (key, until, reason, kind)
            SELECT k, now() + make_interval(secs => s), r, '{REPLY}'
            FROM unnest($1::text[], $2::float8[], $3::text[]) AS v (k, s, r)
            ON CONFLICT (key) DO UPDATE
            SET until = CASE WHEN {ACTIVE} THEN greatest(x.until, excluded.until)
                             ELSE excluded.until END,
                reason = excluded.reason, kind = '{REPLY}',
                created_at = CASE WHEN {ACTIVE} THEN x.created_at ELSE now() END
            WHERE x.until IS NOT NULL AND (x.kind = '{REPLY}' OR x.until <= now())""",
        keys,
        [holds[k][0] for k in keys],
        [holds[k][1] for k in keys],
    )


# An ended suspension is kept this long (an operator looking into a recent hold finds it in the
# table), then deleted: holds come and go with replies, one row per org and site.
KEEP_ENDED = 3600.0


async def prune(db: Executor, *, keep: float = KEEP_ENDED) -> int:
    """Delete suspensions that ended more than `keep` seconds ago; how many."""
    result = await db.execute(
        "DELETE FROM suspension WHERE until < now() - make_interval(secs => $1)", float(keep)
    )
    return int(result.split()[-1])


async def resume(conn: asyncpg.Connection, key: str) -> bool:
    """End the suspension of `key`; False if there was none in force."""
    async with conn.transaction():
        ended = await conn.fetchval(
            f"DELETE FROM suspension x WHERE key = $1 RETURNING {ACTIVE}", key
        )
        if key.startswith(DOMAIN):
            await conn.execute(_FROM_DOMAIN_QUEUE, key)
        elif ended and key.startswith(ORG):
            data = {"by": OPERATOR}
            org_id = uuid.UUID(key.removeprefix(ORG))
            await conn.execute(_ORG_EVENT, org_id, "resumed", json.dumps(data))
    return bool(ended)


_LIST = f"""
SELECT x.key, x.until, x.reason, x.created_at, x.kind,
       (SELECT count(*) FROM recipient r WHERE r.status = 'queued' AND CASE
            WHEN x.key LIKE '{ORG}%' THEN r.org_id::text = substr(x.key, {len(ORG) + 1})
            WHEN x.key LIKE '{LANE}%' THEN r.lane = substr(x.key, {len(LANE) + 1})
            ELSE r.site = x.key END)::integer AS waiting
FROM suspension x WHERE {ACTIVE}
ORDER BY x.created_at
"""


async def list_suspensions(db: Executor) -> list[Suspension]:
    """The suspensions in force, oldest first, with the queued mail each holds."""
    return [Suspension(**dict(row)) for row in await db.fetch(_LIST)]
