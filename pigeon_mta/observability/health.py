"""Liveness and readiness of a node, and the queue gauges set from the supervisor's stats query.

Ready means: not stopping, the database answers, at least one worker process has started all its
services, every configured listener, the HTTP API's included, is bound in at least one live
worker process, and no live worker's recorder is stalled (outbound/recorder.py: results waiting
with none recorded for long: delivered mail would stay `delivering` and be sent again later).
An outbox whose application database no worker reaches is shown (WARN) without making the node
unready: its mail waits in the application's table, and every other door still queues.

How a listener reports "bound": the submission service (and the API service, under the listener
name `api`) sets the multiprocess gauge `metrics.LISTENERS_BOUND.labels(listener=name).set(1)` once
its socket is listening, and `.set(0)` when it closes it. The node's value is the sum over live
processes (a worker that dies stops counting, see `MetricsExposition.worker_exited`), so it also
says in how many processes the listener is up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import asyncpg

from pigeon_mta import metrics
from pigeon_mta.observability.exposition import MetricsExposition, family_name
from pigeon_mta.store.upkeep import QueueStats

DATABASE_CHECK_TIMEOUT = 2.0

_LISTENERS_BOUND = family_name(metrics.LISTENERS_BOUND)
_WORKERS_READY = family_name(metrics.WORKERS_READY)
_RECORDERS_STALLED = family_name(metrics.RECORDERS_STALLED)
_OUTBOXES_REACHABLE = family_name(metrics.OUTBOX_REACHABLE)


# The live-queue statuses of pigeon_queue_recipients: "queued" (not tried yet), "deferred"
# (waiting to be tried again after a failed attempt), "delivering" (claimed, under a lease). Final
# states are history, counted by `pigeon_deliveries_total`, not queue depth.
QUEUE_STATUSES = ("queued", "deferred", "delivering")


class QueueGauges:
    """Sets the queue gauges from the stats query (the supervisor's `Maintenance.on_stats` hook).

    Every configured lane has its series from the first round (0 while it has no mail), so that
    a dashboard shows 0 rather than "no data"; a lane the settings dropped has series once queued
    mail carries it, and 0 once it has none.
    """

    def __init__(self, lanes: Iterable[str]) -> None:
        self._lanes = set(lanes)

    def __call__(self, stats: QueueStats) -> None:
        by_lane = {lane.lane: lane for lane in stats.lanes}
        self._lanes.update(by_lane)
        for name in sorted(self._lanes):
            lane = by_lane.get(name)
            counts = (
                (lane.queued - lane.deferred, lane.deferred, lane.delivering) if lane else (0, 0, 0)
            )
            for status, count in zip(QUEUE_STATUSES, counts, strict=True):
                metrics.QUEUE_RECIPIENTS.labels(status=status, lane=name).set(count)
            metrics.QUEUE_OLDEST_AGE.labels(lane=name).set(lane.oldest_due_age if lane else 0.0)
        metrics.QUEUE_DUE_RECIPIENTS.set(stats.due)
        metrics.WEBHOOK_BACKLOG.set(stats.webhook_backlog)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    # A check that is shown but does not make the node unready (WARN): an application's
    # database that an outbox cannot reach stops that outbox, not the node's mail.
    required: bool = True

    def __str__(self) -> str:
        state = "ok" if self.ok else "FAIL" if self.required else "WARN"
        return f"{self.name}: {state} ({self.detail})"


@dataclass
class Readiness:
    pool: asyncpg.Pool
    exposition: MetricsExposition
    listeners: Sequence[str]
    processes: int
    stopping: asyncio.Event
    outboxes: Sequence[str] = ()

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
        stalled = values.get(_RECORDERS_STALLED, {}).get((), 0.0)
        checks.append(
            Check(
                "recorder",
                stalled == 0,
                "recording"
                if stalled == 0
                else f"{stalled:g} worker process(es) have recorded no delivery result for too "
                "long while results wait (see the log)",
            )
        )
        reachable = values.get(_OUTBOXES_REACHABLE, {})
        for name in self.outboxes:
            count = reachable.get((("outbox", name),), 0.0)
            detail = (
                f"connected in {count:g} process(es)"
                if count
                else "no worker process is connected to the application's database (see the log)"
            )
            checks.append(Check(f"outbox {name}", count >= 1, detail, required=False))
        return checks

    def _process_values(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        return self.exposition.sample_values(
            _WORKERS_READY, _LISTENERS_BOUND, _RECORDERS_STALLED, _OUTBOXES_REACHABLE
        )

    async def _database(self) -> Check:
        try:
            await asyncio.wait_for(self.pool.fetchval("SELECT 1"), DATABASE_CHECK_TIMEOUT)
        except TimeoutError:
            return Check("database", False, f"no answer within {DATABASE_CHECK_TIMEOUT:g}s")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            return Check("database", False, str(exc).strip() or type(exc).__name__)
        return Check("database", True, "reachable")
