"""The queue summary reads the live queue through its partial indexes, never the whole history."""

from __future__ import annotations

import json
import uuid

import asyncpg

from pigeon_mta.store import queue_summary, upkeep
from tests.integration.queue_helpers import bulk_queue
from tests.integration.test_queue import _plan_nodes


async def _scans(pool: asyncpg.Pool, sql: str, *args: object) -> list[tuple[str, str | None]]:
    plan = await pool.fetchval("EXPLAIN (FORMAT JSON) " + sql, *args)
    nodes = _plan_nodes(json.loads(plan) if isinstance(plan, str) else plan)
    return [
        (n["Node Type"], n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") == "recipient"
    ]


async def test_summary_queries_use_the_partial_indexes(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=40_000, status="delivered")
    await bulk_queue(pool, org_id, messages=2_000, due_in=3600, domain="slow.example")
    await bulk_queue(pool, org_id, messages=50, due_in=-10)
    await pool.execute("UPDATE recipient SET attempts = 1 WHERE domain = 'slow.example'")
    await pool.execute("VACUUM ANALYZE recipient")

    live = await _scans(pool, upkeep._STATS)
    assert live and all(kind != "Seq Scan" for kind, _ in live), live
    top = await _scans(pool, queue_summary._TOP_DEFERRED, 10)
    assert {name for _, name in top} == {"recipient_deferred"}, top

    summary = await queue_summary.queue_summary(pool, estimate_above=1000)
    assert summary.counts["queued"] == 2_050 and summary.deferred == 2_000
    assert summary.due == 50
    assert [(lane.lane, lane.queued, lane.deferred, lane.due) for lane in summary.lanes] == [
        ("transactional", 2_050, 2_000, 50)
    ]
    assert [(d.domain, d.deferred) for d in summary.top_deferred] == [("slow.example", 2_000)]
    # History is estimated from the statistics on a big table, exact when asked.
    assert "delivered" in summary.estimated
    assert abs(summary.counts["delivered"] - 40_000) < 4_000
    exact = await queue_summary.queue_summary(pool, exact=True)
    assert exact.counts["delivered"] == 40_000 and not exact.estimated
