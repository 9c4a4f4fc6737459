"""Queue maintenance, one set per node: the lease sweeper, expiry, delay warnings, retention, the
orgs' reputation (reputation.py), stats.

Cheap periodic queries that the supervisor runs beside the worker processes. What follows from them
comes in as hooks: the queue gauges, and the delivery-log records of expiries (`log_expiries`).

Each task of a round stands alone: one that fails for anything but the database being away is
logged, counted in `pigeon_maintenance_failures_total{task}`, and the round goes on with the next,
so that a bug or a bad row in one (a DSN nobody can build) never stops the others (retention,
expiry, the duplicate window) on every node. Within a task, one bad row is the task's to skip
(dsn_queue.py leaves out a DSN it cannot build or queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from pigeon_mta import dsn_queue, metrics, reputation
from pigeon_mta.config import Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.store import duplicates as store_duplicates
from pigeon_mta.store import events as store_events
from pigeon_mta.store import leases as store_leases
from pigeon_mta.store import suspensions as store_suspensions
from pigeon_mta.store import upkeep as store_upkeep
from pigeon_mta.store import webhooks as store_webhooks
from pigeon_mta.store.errors import is_outage

# Logged under the name of the command it runs in: the name is a field of every log line.
log = logging.getLogger("pigeon_mta.serve")


# Expired recipients kept for the delivery log while the database cannot be read, at most.
MAX_UNLOGGED_EXPIRIES = 100_000


@dataclass
class Maintenance:
    """Lease sweeper, expiry, delay warnings, retention and queue stats: cheap periodic queries,
    one set per node."""

    settings: Settings
    pool: asyncpg.Pool
    on_stats: Callable[[store_upkeep.QueueStats], None] = lambda _s: None
    on_expired: Callable[[list[store_upkeep.ExpiredRecipient]], Awaitable[None]] | None = None
    last_stats: store_upkeep.QueueStats | None = None
    healthy: bool = True
    _warned: bool = field(default=False, repr=False)
    # Expired recipients whose delivery-log records are not written yet (the read failed): tried
    # again every round until written, so a database blip does not lose Expiration records.
    _unlogged: list[store_upkeep.ExpiredRecipient] = field(default_factory=list, repr=False)

    async def run(self, stop: asyncio.Event) -> None:
        delivery = self.settings.delivery
        interval = min(delivery.sweep_interval, self.settings.metrics.stats_interval)
        next_sweep = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            now = loop.time()
            try:
                if now >= next_sweep:
                    await self.sweep_once()
                    next_sweep = now + delivery.sweep_interval
                self.last_stats = await store_upkeep.queue_stats(self.pool)
                self.on_stats(self.last_stats)
                if not self.healthy:
                    log.info("database reachable again")
                self.healthy = True
            except Exception as exc:
                if not is_outage(exc):
                    # Sweeping, expiry and stats must outlive a bug in one round.
                    log.exception("queue maintenance round failed")
                else:
                    if self.healthy:
                        log.warning("queue maintenance cannot reach the database: %s", exc)
                    self.healthy = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def sweep_once(self) -> None:
        """One round of every task; a database that is away stops it (raised)."""
        tasks = (
            self._requeue_lost_leases,
            self._expire,
            self._warn_delayed,
            self._purge,
            self._reputation,
        )
        # Named as pigeon_maintenance_failures_total{task} names them (created at 0 at start).
        for name, task in zip(metrics.MAINTENANCE_TASKS, tasks, strict=True):
            await self._task(name, task)

    async def _task(self, name: str, task: Callable[[], Awaitable[Any]]) -> None:
        try:
            await task()
        except Exception as exc:
            if is_outage(exc):
                raise
            metrics.MAINTENANCE_FAILURES.labels(task=name).inc()
            log.exception("queue maintenance: %s failed; the round goes on", name)

    async def _reputation(self) -> None:
        await reputation.evaluate(self.pool, self.settings)

    async def _requeue_lost_leases(self) -> None:
        requeued = await store_leases.requeue_expired_leases(self.pool)
        if requeued:
            log.warning(
                "lease sweeper: %d recipient(s) whose lease ran out are queued again", requeued
            )

    async def _expire(self) -> None:
        # Expiry and the DSNs it owes the senders commit together (dsn_queue.py).
        expired = (
            await dsn_queue.expire_and_bounce(
                self.pool,
                max_age=self.settings.delivery.max_age,
                max_age_text=format_duration(self.settings.delivery.max_age),
                hostname=self.settings.server.hostname,
                lane_max_ages=lane_max_ages(self.settings),
            )
        ).recipients
        if expired:
            log.warning(
                "expiry: %d recipient(s) passed delivery.max_age (or their lane's max_age) and "
                "expired",
                len(expired),
            )
            if self.on_expired is not None:
                self._unlogged.extend(expired)
                if len(self._unlogged) > MAX_UNLOGGED_EXPIRIES:
                    dropped = len(self._unlogged) - MAX_UNLOGGED_EXPIRIES
                    del self._unlogged[:dropped]
                    log.error(
                        "expiry: %d Expiration record(s) will not reach the delivery log (the "
                        "database has them: pigeon-mta log)",
                        dropped,
                    )
        if self._unlogged and self.on_expired is not None:
            await self.on_expired(self._unlogged)
            self._unlogged = []

    async def _warn_delayed(self) -> None:
        warn_after = self.settings.bounces.delay_warning_after
        if warn_after > 0:
            warned = await dsn_queue.warn_delayed(
                self.pool,
                after=warn_after,
                max_age=self.settings.delivery.max_age,
                hostname=self.settings.server.hostname,
                lane_max_ages=lane_max_ages(self.settings),
            )
            if warned.recipients:
                log.info(
                    "delay warnings: %d recipient(s) still retried after %s; %d warning(s) "
                    "queued for their senders",
                    warned.recipients,
                    format_duration(warn_after),
                    len(warned.warnings),
                )

    async def _purge(self) -> None:
        keep = self.settings.retention.messages
        if keep > 0:
            purged = await store_upkeep.purge_finished_messages(self.pool, older_than=keep)
            if purged:
                log.info(
                    "retention: deleted %d finished message(s) older than %s",
                    purged,
                    format_duration(keep),
                )
        # Duplicate-window entries whose window ended; duplicate receptions with their messages.
        await store_duplicates.prune(self.pool, keep_records=keep)
        # Suspensions that ended an hour ago (reply holds come and go: one row per org and site).
        await store_suspensions.prune(self.pool)
        if keep > 0:
            # Webhook events sent or given up, as old as the mail they report on.
            await store_webhooks.prune_finished_events(self.pool, older_than=keep)


def lane_max_ages(settings: Settings) -> list[store_upkeep.LaneMaxAge]:
    """The lanes whose own max_age replaces delivery.max_age (those that set one)."""
    return [
        store_upkeep.LaneMaxAge(name, float(lane.max_age), format_duration(lane.max_age))
        for name, lane in sorted(settings.lanes.items())
        if lane.max_age > 0
    ]


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


async def log_expiries(
    pool: asyncpg.Pool, delivery_log: DeliveryLog, expired: list[store_upkeep.ExpiredRecipient]
) -> None:
    """Recipients the sweeper expired: written to the delivery log, and counted. The read comes
    first: if it fails, nothing is counted, and the maintenance loop calls again next round."""
    stories = await store_events.expiry_stories(pool, [e.recipient_id for e in expired])
    metrics.DELIVERIES.labels(outcome="expired").inc(len(expired))
    delivery_log.stories(stories)
