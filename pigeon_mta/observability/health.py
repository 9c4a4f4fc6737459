"""Liveness and readiness of a node, and the queue gauges set from the supervisor's stats query.

Ready means: not stopping, the database answers, at least one worker process has started all its
services, and every configured listener is bound in at least one live worker process.

How a listener reports "bound": the submission service sets the multiprocess gauge
`metrics.LISTENERS_BOUND.labels(listener=name).set(1)` once its socket is listening, and `.set(0)`
when it closes it. The node's value is the sum over live processes (a worker that dies stops
counting, see `MetricsExposition.worker_exited`), so it also says in how many processes the
listener is up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from pigeon_mta import metrics
from pigeon_mta.observability.exposition import MetricsExposition, family_name
from pigeon_mta.store.upkeep import QueueStats

DATABASE_CHECK_TIMEOUT = 2.0

_LISTENERS_BOUND = family_name(metrics.LISTENERS_BOUND)
_WORKERS_READY = family_name(metrics.WORKERS_READY)


def publish_queue_stats(stats: QueueStats) -> None:
    """Set the queue gauges (the supervisor's `Maintenance.on_stats` hook).

    `status` partitions the live queue: "queued" (not tried yet), "deferred" (waiting to be
    tried again after a failed attempt), "delivering" (claimed, under a lease). Final states are
    history, counted by `pigeon_deliveries_total`, not queue depth.
    """
    metrics.QUEUE_RECIPIENTS.labels(status="queued").set(stats.queued - stats.deferred)
    metrics.QUEUE_RECIPIENTS.labels(status="deferred").set(stats.deferred)
    metrics.QUEUE_RECIPIENTS.labels(status="delivering").set(stats.delivering)
    metrics.QUEUE_DUE_RECIPIENTS.set(stats.due)
    metrics.QUEUE_OLDEST_AGE.set(stats.oldest_due_age)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {'ok' if self.ok else 'FAIL'} ({self.detail})"


@dataclass
class Readiness:
    pool: asyncpg.Pool
    exposition: MetricsExposition
    listeners: Sequence[str]
    processes: int
    stopping: asyncio.Event

    async def checks(self) -> list[Check]:
        if self.stopping.is_set():
            return [Check("node", False, "stopping: draining in-flight work")]
        checks = [await self._database()]
        values = await asyncio.to_thread(self._process_values)
        ready = values.get(_WORKERS_READY, {}).get((), 0.0)
        checks.append(
            Check("workers", ready >= 1, f"{ready:g} of {self.processes} worker process(es) ready")
        )
        bound = values.get(_LISTENERS_BOUND, {})
        for name in self.listeners:
            count = bound.get((("listener", name),), 0.0)
            checks.append(Check(f"listener {name}", count >= 1, f"bound in {count:g} process(es)"))
        return checks

    def _process_values(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        return self.exposition.sample_values(_WORKERS_READY, _LISTENERS_BOUND)

    async def _database(self) -> Check:
        try:
            await asyncio.wait_for(self.pool.fetchval("SELECT 1"), DATABASE_CHECK_TIMEOUT)
        except TimeoutError:
            return Check("database", False, f"no answer within {DATABASE_CHECK_TIMEOUT:g}s")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            return Check("database", False, str(exc).strip() or type(exc).__name__)
        return Check("database", True, "reachable")
