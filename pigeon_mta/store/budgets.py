"""Budgets shared by the cluster: token grants, leased session slots, throttling and its backoff.

A budget is a row of `budget` (migration 0018): a token bucket for a message rate and a count of
SMTP sessions for a concurrency, each with its configured and its effective value (lower while a
destination backs off after throttling replies). Engines never take one token or one slot at a
time: `take_grants` serves every key a claim round needs in one call of `budget_take`, and what an
engine holds it keeps in memory (outbound/budgets.py). Slots are leased to their holder (the
engine's `<node>/<run>`): a holder that dies stops blocking the destination when its lease ends.
Budgets are cross-tenant by design (a destination's budget serves every org). How a site's
effective values follow its replies (backoff, recovery, reply rules' limits) is the site
controller's (pigeon_mta/site_control.py, driven by store/controls.py).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.store.controls import recover_budgets
from pigeon_mta.store.executor import Executor

# Every key of a budget starts with its kind.
DESTINATION = "destination:"
LANE = "lane:"
ORG = "org:"

# The egress source mail leaves from (its IP addresses and their reputation). A site's budget
# is one per (source, site): a server limits what it takes from each sending IP, and a
# throttling reply to one source says nothing of another's. One source today; the default
# source's keys are written without it (`destination:SITE`), so that keys stay as they were.
DEFAULT_SOURCE = "default"
_SOURCE = "source:"


def site_budget_key(source: str, site: str) -> str:
    """The budget key of `site` (a destination policy's key) as seen from `source`."""
    if source == DEFAULT_SOURCE:
        return DESTINATION + site
    return f"{DESTINATION}{_SOURCE}{source}/{site}"


def source_and_site(key: str) -> tuple[str, str]:
    """A site budget key's (source, site); the inverse of `site_budget_key`."""
    rest = key.removeprefix(DESTINATION)
    if rest.startswith(_SOURCE) and "/" in rest:
        source, site = rest.removeprefix(_SOURCE).split("/", 1)
        return source, site
    return DEFAULT_SOURCE, rest


@dataclass(frozen=True)
class GrantRequest:
    """What an engine asks of one budget: its configuration (written into the row), the tokens
    it needs now and the session slots it needs beyond those it holds."""

    key: str
    rate: float  # configured messages per second (0: no rate)
    concurrency: int  # configured sessions (0: no limit)
    burst: float
    tokens: int
    slots: int


@dataclass(frozen=True)
class Grant:
    key: str
    tokens: int
    slots: int  # granted by this call
    held: int  # slots the caller holds now, these included
    booked_from: datetime  # the first message handed back for want of tokens is due then
    effective_rate: float  # 0: no limit
    effective_concurrency: int  # 0: no limit
    held_until: datetime | None  # a retry delay the destination stated
    parked_until: datetime | None = None  # a dead site's next probe (report_connections)


async def take_grants(
    db: Executor,
    requests: Sequence[GrantRequest],
    *,
    holder: str,
    lease: float,
    horizon: float,
    stale: float,
) -> dict[str, Grant]:
    """Tokens and slots for every requested budget, in one statement (budget_take). Mail handed
    back for want of tokens is booked at most `horizon` seconds ahead. Slots of holders that are
    not a live run of their node (a heartbeat older than `stale` seconds) are freed first."""
    rows = await db.fetch(
        "SELECT * FROM budget_take($1::text[], $2::float8[], $3::int[], $4::float8[],"
        " $5::int[], $6::int[], $7, $8, $9, $10, $11, $12)",
        [r.key for r in requests],
        [float(r.rate) for r in requests],
        [r.concurrency for r in requests],
        [float(r.burst) for r in requests],
        [r.tokens for r in requests],
        [r.slots for r in requests],
        holder,
        float(lease),
        float(horizon),
        # No recovery in the statement (a quiet period of 0): the controller's, store/controls.py.
        0.0,
        0.0,
        float(stale),
    )
    return {
        row["key"]: Grant(
            key=row["key"],
            tokens=row["tokens"],
            slots=row["slots"],
            held=row["held"],
            booked_from=row["booked_from"],
            effective_rate=row["effective_rate"],
            effective_concurrency=row["effective_concurrency"],
            held_until=row["held_until"],
            parked_until=row["parked_until"],
        )
        for row in rows
    }


# The slots a holder keeps, renewed for another lease, and no more than the budget allows now
# (a backoff may have lowered its concurrency below what is held: the holder then lets its
# sessions end until it is within). A key kept at 0 gives every slot back.
_HOLD_SLOTS = """
WITH v AS (
    SELECT * FROM unnest($1::text[], $2::int[]) AS v (key, slots)
), returned AS (
    DELETE FROM budget_slot s USING v
    WHERE s.key = v.key AND s.holder = $3 AND v.slots = 0
), others AS (
    SELECT s.key, sum(s.slots)::integer AS n FROM budget_slot s JOIN v USING (key)
    WHERE s.holder <> $3 AND s.lease_until >= now()
    GROUP BY s.key
)
UPDATE budget_slot s
SET slots = CASE WHEN b.effective_concurrency > 0
                 THEN least(v.slots, greatest(0, b.effective_concurrency - coalesce(o.n, 0)))
                 ELSE v.slots END,
    lease_until = now() + make_interval(secs => $4)
FROM v JOIN budget b USING (key) LEFT JOIN others o USING (key)
WHERE s.key = v.key AND s.holder = $3 AND v.slots > 0
RETURNING s.key, s.slots
"""


async def hold_slots(
    db: Executor, keep: Mapping[str, int], *, holder: str, lease: float
) -> dict[str, int]:
    """Keep `keep[key]` slots of each budget under a fresh lease (0 gives them all back);
    returns what the holder may keep, which can be less, and nothing for keys it lost."""
    if not keep:
        return {}
    rows = await db.fetch(_HOLD_SLOTS, list(keep), list(keep.values()), holder, float(lease))
    return {row["key"]: row["slots"] for row in rows}


async def free_slots_of_gone_runs(db: Executor, node_name: str, run_owner: str) -> int:
    """At node start: the slots that earlier runs of this node name held (holders are
    `<node>/<run>#<pid>`) are free at once instead of when their lease runs out. The node name
    was just taken (pigeon_mta/node.py), so no other run of it is live."""
    tag = await db.execute(
        """DELETE FROM budget_slot
           WHERE starts_with(holder, $1 || '/') AND NOT starts_with(holder, $2 || '#')""",
        node_name,
        run_owner,
    )
    return int(tag.rsplit(" ", 1)[-1])


@dataclass(frozen=True)
class Connections:
    """What one engine's connections to one site did since its last report."""

    key: str
    failed: int  # connections that failed in a row at the end (0: the last one was healthy)
    healthy: bool  # one was healthy: the count starts again from `failed`
    reason: str  # the last failure, as the log shows it


# Failed connections in a row, cluster-wide; a healthy one starts the count again and ends a
# parking. A site that reaches $5 failures is parked for $6 seconds; a failed probe (site_pick
# marks it `probing`) parks it twice as long as the last time, $7 seconds at the most. Failures
# of deliveries that were under way when it was parked change nothing. The rows are locked in key
# order first (budget_take's order), so concurrent reports add up.
_ENSURE = """
INSERT INTO budget (key, tokens) SELECT k, 0 FROM unnest($1::text[]) AS k ORDER BY 1
ON CONFLICT (key) DO NOTHING
"""
_CONNECTIONS = """
WITH v AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::bool[], $4::text[])
        AS v (key, failed, healthy, reason)
), c AS (
    SELECT * FROM budget WHERE key = ANY ($1::text[]) ORDER BY key FOR UPDATE
), x AS (
    SELECT v.key, v.reason, c.parked_until IS NOT NULL AS was_parked,
           CASE WHEN v.healthy THEN v.failed ELSE c.failures + v.failed END AS total,
           v.healthy, v.failed, c.parked_until, c.probing, c.park_seconds
    FROM v JOIN c USING (key)
), y AS (
    SELECT x.*,
           -- (after a healthy one, only the failures that followed it count)
           CASE WHEN x.healthy OR x.parked_until IS NULL THEN
                    CASE WHEN $5 > 0 AND x.total >= $5 THEN $6::float8 ELSE 0 END
                WHEN x.probing AND x.failed > 0 THEN least($7, greatest($6, x.park_seconds * 2))
                ELSE x.park_seconds END AS secs
    FROM x
)
UPDATE budget b
SET failures = y.total,
    park_seconds = y.secs,
    parked_until = CASE WHEN y.secs = 0 THEN NULL
                        WHEN y.parked_until IS NULL OR y.healthy OR (y.probing AND y.failed > 0)
                            THEN now() + make_interval(secs => y.secs)
                        ELSE y.parked_until END,
    probing = CASE WHEN y.secs = 0 OR y.failed > 0 THEN false ELSE b.probing END,
    parked_reason = CASE WHEN y.secs = 0 THEN NULL
                         WHEN y.parked_until IS NULL OR y.healthy OR (y.probing AND y.failed > 0)
                             THEN y.reason
                         ELSE b.parked_reason END,
    updated_at = now()
FROM y WHERE b.key = y.key
RETURNING b.key, b.parked_until, y.was_parked
"""


@dataclass(frozen=True)
class ParkingChange:
    key: str
    parked_until: datetime | None  # None: not parked (any more)
    was_parked: bool


async def report_connections(
    db: asyncpg.Pool,
    reports: Sequence[Connections],
    *,
    park_after: int,
    park_for: float,
    park_max: float,
) -> list[ParkingChange]:
    """Count each site's failed connections in a row and park or unpark it (one statement);
    returns each site's parking after the report."""
    if not reports:
        return []
    reports = sorted(reports, key=lambda r: r.key)
    keys = [r.key for r in reports]
    # The missing rows first, in a statement of their own (one transaction with the update
    # would keep the new rows locked while it waits for the others, against budget_throttled,
    # which locks a row and then inserts the next); the update is one statement.
    await db.execute(_ENSURE, keys)
    rows = await db.fetch(
        _CONNECTIONS,
        keys,
        [r.failed for r in reports],
        [r.healthy for r in reports],
        [r.reason for r in reports],
        park_after,
        float(park_for),
        float(park_max),
    )
    return [ParkingChange(r["key"], r["parked_until"], r["was_parked"]) for r in rows]


@dataclass(frozen=True)
class InForce:
    """Budgets an engine must ask for that its configuration does not name."""

    org_rates: dict[uuid.UUID, float]
    backing_off: frozenset[str]
    parked: frozenset[str] = frozenset()
    # Destinations without configured limits held at what they took before a backoff.
    capped: frozenset[str] = frozenset()
    # Operator suspensions in force (store/suspensions.py): key -> reason, with when it ends.
    suspended: dict[str, str] = dataclasses.field(default_factory=dict)


async def budgets_in_force(db: asyncpg.Pool, *, step: float, quiet: float) -> InForce:
    """What `InForce` says, read after the controller's recovery of every budget backing off or
    capped (store/controls.py); each engine reads it once a second while it delivers."""
    await recover_budgets(db, step=step, quiet=quiet)
    rows = await db.fetch("SELECT * FROM budget_in_force($1, 0)", float(step))
    return InForce(
        org_rates={uuid.UUID(r["key"]): r["rate"] for r in rows if r["kind"] == "org"},
        backing_off=frozenset(r["key"] for r in rows if r["kind"] == "backoff"),
        parked=frozenset(r["key"] for r in rows if r["kind"] == "parked"),
        capped=frozenset(r["key"] for r in rows if r["kind"] == "capped"),
        suspended={r["key"]: r["note"] for r in rows if r["kind"] == "suspended"},
    )


@dataclass(frozen=True)
class BudgetState:
    """One budget as `pigeon-mta queue` shows it."""

    key: str
    name: str  # the org's name for an org budget, else the key without its kind
    rate: float
    concurrency: int
    effective_rate: float
    effective_concurrency: int
    sessions: int  # slots held under a live lease
    backoff: bool
    throttled_at: datetime | None
    held_until: datetime | None
    last_reply: str | None
    waiting: int = 0  # recipients in its site queue (a destination's budget)
    parked_until: datetime | None = None  # a dead site's next probe
    parked_reason: str | None = None
    capped: bool = False  # held at what it took before a backoff (no limits configured)


_LIST = """
SELECT b.key, coalesce(o.name, b.key) AS name, coalesce(o.rate, b.rate) AS rate,
       b.concurrency, b.effective_rate,
       b.effective_concurrency, b.backoff, b.throttled_at, b.held_until, b.last_reply,
       b.parked_until, b.parked_reason, b.capped,
       (SELECT coalesce(sum(s.slots), 0)::integer FROM budget_slot s
        WHERE s.key = b.key AND s.lease_until >= now()) AS sessions,
       (SELECT count(*)::integer FROM recipient r
        WHERE r.site = b.key AND r.status = 'queued') AS waiting
FROM budget b
LEFT JOIN org o ON b.key LIKE 'org:%' AND o.id::text = substr(b.key, 5)
-- An org's configured rate is the org's own (a rate set back to 0 leaves its row behind).
WHERE CASE WHEN b.key LIKE 'org:%' THEN coalesce(o.rate, 0) > 0
           ELSE b.backoff OR b.capped OR b.rate > 0 OR b.concurrency > 0
                OR b.parked_until IS NOT NULL END
ORDER BY b.parked_until IS NOT NULL DESC, b.backoff DESC, b.key
"""


async def list_budgets(db: Executor) -> list[BudgetState]:
    """Every budget with a limit in force, those backing off first."""
    return [
        BudgetState(
            key=r["key"],
            name=r["name"].split(":", 1)[1] if r["name"] == r["key"] else r["name"],
            rate=r["rate"],
            concurrency=r["concurrency"],
            effective_rate=r["effective_rate"],
            effective_concurrency=r["effective_concurrency"],
            sessions=r["sessions"],
            backoff=r["backoff"],
            throttled_at=r["throttled_at"],
            held_until=r["held_until"],
            last_reply=r["last_reply"],
            waiting=r["waiting"],
            parked_until=r["parked_until"],
            parked_reason=r["parked_reason"],
            capped=r["capped"],
        )
        for r in await db.fetch(_LIST)
    ]
