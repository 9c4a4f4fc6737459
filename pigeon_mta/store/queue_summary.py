"""The queue's summary (`pigeon-mta queue`): recipients per status, what is due, the oldest wait,
the destinations with the most deferred mail and each lane's live queue.

The live part of the table is read through its partial indexes (store/upkeep.py `queue_stats`),
so the cost follows the queue, not the history of delivered mail; the history's counts are the
planner's estimate once the table is big (`ESTIMATE_ABOVE`), exact on request.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pigeon_mta.model import Status
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.upkeep import LaneStats, queue_stats

HISTORY_STATUSES = (
    Status.DELIVERED,
    Status.BOUNCED,
    Status.EXPIRED,
    Status.CANCELLED,
    Status.SUPPRESSED,
)


@dataclass(frozen=True)
class Destination:
    domain: str
    deferred: int
    last_code: int | None
    last_enhanced_code: str | None
    last_response: str | None
    last_at: datetime


@dataclass(frozen=True)
class QueueSummary:
    counts: dict[str, int]  # recipients per status
    estimated: frozenset[str]  # statuses whose count is the planner's estimate, not a count
    due: int  # queued and due now
    deferred: int  # queued after at least one attempt
    oldest_due_age: float  # seconds the longest-waiting due recipient has waited (0 if none)
    top_deferred: list[Destination]
    lanes: tuple[LaneStats, ...] = ()  # the live queue of each lane that has live rows
    scheduled: int = 0  # queued, never tried, not due yet (a send intent's send_at)


# One pass over recipient_deferred gives the count per destination; the latest reply of each top
# destination is one backward index step.
_TOP_DEFERRED = """
WITH g AS MATERIALIZED (
    SELECT domain, count(*) AS deferred FROM recipient
    WHERE status = 'queued' AND attempts > 0
    GROUP BY domain
)
SELECT t.domain, t.deferred, l.last_code, l.last_enhanced_code, l.last_response,
       l.updated_at
FROM (SELECT domain, deferred FROM g
      ORDER BY deferred DESC, domain LIMIT $1) t
CROSS JOIN LATERAL (
    SELECT last_code, last_enhanced_code, last_response, updated_at FROM recipient
    WHERE status = 'queued' AND attempts > 0 AND domain = t.domain
    ORDER BY updated_at DESC LIMIT 1) l
ORDER BY t.deferred DESC, t.domain
"""

# Finished recipients are history and may be many millions: counting them is a full scan. Unless
# asked for exact counts, take the planner's figures (row estimate scaled to the table's current
# size, times each status's frequency in the statistics) when the table is big enough to matter.
_ESTIMATE = """
SELECT c.reltuples, c.relpages,
       pg_relation_size(c.oid) / current_setting('block_size')::int AS pages_now,
       s.most_common_vals::text::text[] AS vals, s.most_common_freqs AS freqs
FROM pg_class c
LEFT JOIN pg_stats s ON s.schemaname = current_schema() AND s.tablename = c.relname
                     AND s.attname = 'status'
WHERE c.oid = 'recipient'::regclass
"""

_EXACT_HISTORY = """
SELECT status, count(*) FROM recipient
WHERE status <> ALL (ARRAY['queued', 'delivering']) GROUP BY status
"""

ESTIMATE_ABOVE = 200_000  # rows in the table; below this an exact count is cheap


async def queue_summary(
    db: Executor, *, top: int = 10, exact: bool = False, estimate_above: int = ESTIMATE_ABOVE
) -> QueueSummary:
    # The live part of the table only, through the partial indexes (upkeep.queue_stats), so the
    # cost follows the queue, not the history of delivered mail.
    live = await queue_stats(db)
    counts: dict[str, int] = {s: 0 for s in Status}
    counts[Status.QUEUED] = live.queued
    counts[Status.DELIVERING] = live.delivering
    history, estimated = await _history_counts(db, exact=exact, estimate_above=estimate_above)
    counts.update(history)
    rows = await db.fetch(_TOP_DEFERRED, max(top, 1))
    destinations = [
        Destination(
            domain=r["domain"],
            deferred=r["deferred"],
            last_code=r["last_code"],
            last_enhanced_code=r["last_enhanced_code"],
            last_response=r["last_response"],
            last_at=r["updated_at"],
        )
        for r in rows[:top]
    ]
    return QueueSummary(
        counts=counts,
        estimated=estimated,
        due=live.due,
        deferred=live.deferred,
        oldest_due_age=live.oldest_due_age,
        top_deferred=destinations,
        lanes=live.lanes,
        scheduled=live.scheduled,
    )


async def _history_counts(
    db: Executor, *, exact: bool, estimate_above: int
) -> tuple[dict[str, int], frozenset[str]]:
    if not exact:
        stats = await db.fetchrow(_ESTIMATE)
        if stats is not None and stats["vals"] is not None and stats["reltuples"] > 0:
            rows = float(stats["reltuples"])
            if stats["relpages"] > 0:
                rows = rows / stats["relpages"] * stats["pages_now"]
            if rows >= estimate_above:
                freqs = dict(zip(stats["vals"], stats["freqs"], strict=True))
                counts = {str(s): round(rows * freqs.get(str(s), 0.0)) for s in HISTORY_STATUSES}
                return counts, frozenset(counts)
    rows_by_status = await db.fetch(_EXACT_HISTORY)
    return {r["status"]: r["count"] for r in rows_by_status}, frozenset()
