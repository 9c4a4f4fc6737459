"""Dead sites: failed connections counted for the cluster, and the sites they park.

A connection that fails (refused, timed out, broken before a reply) counts against its site; a
healthy one (any reply) starts the count again. An engine reports failures as they come, and a
healthy connection only to a site it knows to be failing (it reported failures there, or the site
is parked), so a healthy site costs no statement. Reports are merged per site and sent in one
transaction (store/budgets.py, report_connections), which parks a site after
`delivery.park_after` failures in a row: its mail then waits in the site's queue while one probe
at a time is tried (store/migrations/0024, site_pick).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.store import budgets as store
from pigeon_mta.store.budgets import Connections
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger(__name__)

# Outcomes that arrive within this window share one statement.
REPORT_WINDOW = 0.05


@dataclass
class _Pending:
    failed: int = 0
    healthy: bool = False
    reason: str = ""


class SiteHealth:
    """This process's reports of failed and healthy connections per site."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool) -> None:
        self.delivery = settings.delivery
        self.pool = pool
        self.failing: set[str] = set()  # budget keys with failures reported, or parked
        self._pending: dict[str, _Pending] = {}
        self._reporter: asyncio.Task[None] | None = None

    def failed(self, key: str, reason: str) -> None:
        if self.delivery.park_after <= 0:
            return
        pending = self._pending.setdefault(key, _Pending())
        pending.failed += 1
        pending.reason = reason
        self._schedule()

    def healthy(self, key: str) -> None:
        if key not in self.failing and key not in self._pending:
            return
        self._pending[key] = _Pending(healthy=True)
        self._schedule()

    def moved(self, key: str) -> None:
        """Mail claimed from the queue of site `key` routes elsewhere now (its MX set changed):
        that site is not parked any more (its queue goes back to the general claim), whatever
        this process knew of it."""
        self._pending[key] = _Pending(healthy=True)
        self._schedule()

    def _schedule(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report(), name="site-health")

    async def _report(self) -> None:
        while self._pending:
            await asyncio.sleep(REPORT_WINDOW)
            pending, self._pending = self._pending, {}
            reports = [Connections(k, p.failed, p.healthy, p.reason) for k, p in pending.items()]
            try:
                changes = await store.report_connections(
                    self.pool,
                    reports,
                    park_after=self.delivery.park_after,
                    park_for=self.delivery.park_for,
                    park_max=self.delivery.park_max,
                )
            except DB_ERRORS as exc:
                log.warning("cannot report failed connections: %s", exc)
                return
            for change in changes:
                if change.parked_until is not None:
                    self.failing.add(change.key)
                    if not change.was_parked:
                        log.warning(
                            "site %s is parked after failed connections (%s): its mail waits, "
                            "a probe is tried at %s",
                            change.key,
                            pending[change.key].reason,
                            change.parked_until.isoformat(timespec="seconds"),
                        )
                elif change.was_parked:
                    self.failing.discard(change.key)
                    log.info("site %s answers again: no longer parked", change.key)
                elif pending[change.key].healthy:
                    self.failing.discard(change.key)
                else:
                    self.failing.add(change.key)

    async def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reporter
