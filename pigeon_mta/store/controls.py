"""The site controller's state in table `budget`, read and written under the row's lock: every
engine of every node drives the one controller (pigeon_mta/site_control.py, pure) with its
reports. Each call locks the rows it changes in key order (budget_take's lock order), then reads
the database's clock, so that every decision is made at one time, after the lock is won.

Rows a report needs are inserted first, in a statement of their own: inserted in the locking
transaction they would stay locked while it waits for the others' locks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from pigeon_mta import site_control
from pigeon_mta.site_control import COLUMNS, Report, SiteControl


@dataclass(frozen=True)
class Throttling:
    """Throttling replies of one destination seen by one engine since its last report."""

    key: str
    holder: str  # the engine (budget_slot's holder): each adds its own traffic once per decrease
    rate: float  # what the engine was sending there (messages per second, at least 1)
    concurrency: int  # its sessions there (at least 1)
    reply: str


@dataclass(frozen=True)
class Limit:
    """A reply rule's limit of one site (`[[shaping.rule]]` action rate or sessions)."""

    key: str
    rate: float  # messages a second at most (0: the rate unchanged)
    sessions: int  # sessions at once at most (0: unchanged)
    seconds: float  # for how long
    reason: str


_ENSURE = """
INSERT INTO budget (key, tokens) SELECT k, 0 FROM unnest($1::text[]) AS k ORDER BY 1
ON CONFLICT (key) DO NOTHING
"""
# `waiting`: mail in the site's queue (a capped site probes upward only then).
_WAITING = "EXISTS (SELECT 1 FROM recipient r WHERE r.status = 'queued' AND r.site = b.key)"
_LOCK = f"""
SELECT b.key, {", ".join("b." + c for c in COLUMNS)}, b.capped AND {_WAITING} AS waiting
FROM budget b
WHERE {{where}}
ORDER BY b.key
FOR NO KEY UPDATE OF b {{skip}}
"""
# The budgets whose recovery step or probe is due (site_control.recovered), and no other: the
# rest are not locked at all, so that the site claim and the grants never wait for them.
_DUE = f"""
(b.backoff AND greatest(b.changed_at, b.throttled_at, b.limited_until)
               <= now() - make_interval(secs => $1))
OR (b.capped AND NOT b.backoff AND b.rate <= 0 AND b.concurrency <= 0
    AND greatest(b.changed_at, b.throttled_at) <= now() - make_interval(secs => 2 * $1)
    AND {_WAITING})
"""
_WRITE = (
    "UPDATE budget SET "
    + ", ".join(f"{c} = ${n}" for n, c in enumerate(COLUMNS, start=2))
    + f", updated_at = ${len(COLUMNS) + 2} WHERE key = $1"
)

# One step of the controller for one budget: (key, state, the database's time, mail waiting).
Step = Callable[[str, SiteControl, datetime, bool], SiteControl]


async def _drive(
    pool: asyncpg.Pool,
    keys: Sequence[str] | None,
    step: Step,
    *,
    ensure: bool,
    quiet: float = 0.0,
) -> None:
    """Lock the budgets `keys` (None: those whose recovery after `quiet` seconds is due,
    passing over those another engine holds), apply `step` to each at the database's time,
    write what changed."""
    if ensure and keys:
        await pool.execute(_ENSURE, sorted(keys))
    async with pool.acquire() as conn, conn.transaction():
        if keys is None:
            query = _LOCK.format(where=_DUE, skip="SKIP LOCKED")
            rows = await conn.fetch(query, float(quiet))
        else:
            query = _LOCK.format(where="b.key = ANY ($1::text[])", skip="")
            rows = await conn.fetch(query, sorted(keys))
        if not rows:
            return
        now = await conn.fetchval("SELECT clock_timestamp()")
        writes = []
        for row in rows:
            state: dict[str, Any] = {c: row[c] for c in COLUMNS}
            state["reporters"] = tuple(state["reporters"] or ())
            before = SiteControl(**state)
            after = step(row["key"], before, now, bool(row["waiting"]))
            if after != before:
                values = [
                    list(after.reporters) if c == "reporters" else getattr(after, c)
                    for c in COLUMNS
                ]
                writes.append((row["key"], *values, now))
        if writes:
            await conn.executemany(_WRITE, writes)


async def report_throttling(
    pool: asyncpg.Pool, reports: Sequence[Throttling], *, factor: float, hold: float
) -> None:
    """Lower each throttled site's rate and sessions for the whole cluster (site_control
    .throttled). One report per key: the caller merges them."""
    if not reports:
        return
    by_key = {r.key: Report(r.holder, float(r.rate), int(r.concurrency), r.reply) for r in reports}
    await _drive(
        pool,
        list(by_key),
        lambda key, c, now, _waiting: site_control.throttled(
            c, by_key[key], now, factor=factor, hold=hold
        ),
        ensure=True,
    )


async def limit_budgets(pool: asyncpg.Pool, limits: Sequence[Limit]) -> None:
    """Hold each site's rate or sessions at most at its limit for the cluster until the
    limit's time ends (site_control.limited)."""
    if not limits:
        return
    by_key = {x.key: x for x in limits}

    def step(key: str, c: SiteControl, now: datetime, _waiting: bool) -> SiteControl:
        x = by_key[key]
        return site_control.limited(c, x.rate, x.sessions, x.seconds, x.reason, now)

    await _drive(pool, list(by_key), step, ensure=True)


async def recover_budgets(
    pool: asyncpg.Pool, *, step: float, quiet: float, keys: Sequence[str] | None = None
) -> None:
    """Apply the quiet periods that passed to every budget backing off or capped (or to
    `keys`): recovery steps and the capped probe (site_control.recovered)."""
    await _drive(
        pool,
        keys,
        lambda _key, c, now, waiting: site_control.recovered(
            c, now, step=step, quiet=quiet, waiting=waiting
        ),
        ensure=False,
        quiet=quiet,
    )
