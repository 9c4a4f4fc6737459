"""Throttling replies reported for the cluster, with what this process was sending at the time.

A reply classified rate-limited lowers the destination's effective rate and concurrency for every
node (store/budgets.py: multiplicatively, then additive recovery). The decrease starts from what
was being sent: the limits in force, or, for a destination without any, the rates and sessions
of every process that reports within the decrease's hold, added up. Each process keeps count of
its own for every destination (a few dict operations per transaction, no statement). Replies are
merged per destination and reported in one statement.

A retry delay the reply states holds the site for the org whose mail got it (a suspension of
kind 'reply', store/suspensions.py), not for every org: this process holds it at once, the
others when they next read the suspensions (within a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.metrics import DESTINATION_THROTTLING
from pigeon_mta.model import Reply
from pigeon_mta.outbound.limits import DestinationPolicy
from pigeon_mta.plain import plain_text
from pigeon_mta.store import controls as store
from pigeon_mta.store import suspensions
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.controls import Limit, Throttling

log = logging.getLogger(__name__)

# Throttling replies within this many seconds of a decrease are the same overload.
DECREASE_HOLD = 1.0
# Replies that arrive within this window share one statement.
REPORT_WINDOW = 0.005
# A report the database refused is tried again, after a wait that doubles up to this.
RETRY_MAX = 5.0
# What a report keeps of the reply it quotes.
MAX_REASON = 500
# Destinations whose traffic is remembered before the record starts over.
MAX_TRAFFIC_KEYS = 10000


@dataclass
class _Traffic:
    """This process's recent sending to one destination."""

    in_flight: int = 0
    window_start: float = 0.0
    count: int = 0
    rate: float = 0.0  # messages a second over the last whole window

    def sent(self, now: float) -> None:
        if now - self.window_start >= 1.0:
            self.rate = self.count / max(1.0, now - self.window_start)
            self.window_start, self.count = now, 0
        self.count += 1


class ThrottlingReports:
    """Counts this process's traffic per destination and reports throttling replies."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, holder: str) -> None:
        self.delivery = settings.delivery
        self.pool = pool
        self.holder = holder
        self._traffic: dict[str, _Traffic] = {}
        self._reports: dict[str, Throttling] = {}
        self._holds: dict[str, tuple[float, str]] = {}  # hold key: (seconds, reason)
        self._limits: dict[str, Limit] = {}
        self._reporter: asyncio.Task[None] | None = None

    def sending(self, policy: DestinationPolicy) -> None:
        """A transaction to this destination starts."""
        traffic = self._traffic.get(policy.key)
        if traffic is None:
            if len(self._traffic) >= MAX_TRAFFIC_KEYS:
                self._traffic = {k: t for k, t in self._traffic.items() if t.in_flight}
            traffic = self._traffic[policy.key] = _Traffic(window_start=time.monotonic())
        traffic.in_flight += 1
        traffic.sent(time.monotonic())

    def sent(self, policy: DestinationPolicy) -> None:
        """A transaction to this destination is over."""
        traffic = self._traffic.get(policy.key)
        if traffic is not None:
            traffic.in_flight -= 1

    def throttled(self, policy: DestinationPolicy, reply: Reply) -> None:
        """Report a throttling reply from this destination (in a batch, at once)."""
        key = policy.budget_key
        configured = policy.rate > 0 or policy.cluster_concurrency > 0
        DESTINATION_THROTTLING.labels(destination=key if configured else "other").inc()
        traffic = self._traffic.get(policy.key) or _Traffic()
        earlier = self._reports.get(key)
        self._reports[key] = Throttling(
            key,
            self.holder,
            max(traffic.rate, float(traffic.count), earlier.rate if earlier else 1.0),
            max(traffic.in_flight, earlier.concurrency if earlier else 1),
            plain_text(str(reply), MAX_REASON),
        )
        self._report_soon()

    def hold(self, key: str, seconds: float, reason: str) -> None:
        """Report a suspension a reply asked for: a site's for one org (`suspensions.hold_key`)
        or a site's for all."""
        # The reason quotes the destination's reply: plain and bounded, storable whatever bytes
        # the reply held.
        self._add_hold(key, seconds, plain_text(reason, MAX_REASON))
        self._report_soon()

    def _add_hold(self, key: str, seconds: float, reason: str) -> None:
        earlier = self._holds.get(key)
        if earlier is None or seconds > earlier[0]:
            self._holds[key] = (seconds, reason)

    def limit(self, key: str, rate: float, sessions: int, seconds: float, reason: str) -> None:
        """Report a reply rule's limit of a site's rate or sessions (0: unchanged), for
        `seconds`."""
        self._add_limit(Limit(key, rate, sessions, seconds, plain_text(reason, MAX_REASON)))
        self._report_soon()

    def _add_limit(self, limit: Limit) -> None:
        """Two limits of one site before a report are one: the lower rate and sessions (of
        those each sets), the longer time."""
        earlier = self._limits.get(limit.key)
        if earlier is not None:
            limit = Limit(
                limit.key,
                _lower(earlier.rate, limit.rate),
                int(_lower(earlier.sessions, limit.sessions)),
                max(earlier.seconds, limit.seconds),
                limit.reason,
            )
        self._limits[limit.key] = limit

    def _report_soon(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report(), name="budget-throttling")

    async def _report(self) -> None:
        """Report what waits, each kind in its own statement; what the database refused is
        kept (merged with what came since) and tried again after a growing wait, so that an
        outage of the database loses no hold or limit."""
        wait = REPORT_WINDOW
        while self._reports or self._holds or self._limits:
            await asyncio.sleep(wait)
            refused = False
            reports, self._reports = list(self._reports.values()), {}
            if reports:
                try:
                    await store.report_throttling(
                        self.pool,
                        reports,
                        factor=self.delivery.backoff_factor,
                        hold=DECREASE_HOLD,
                    )
                except DB_ERRORS as exc:
                    refused = True
                    log.warning("cannot report throttling replies (will retry): %s", exc)
                    for report in reports:
                        self._reports.setdefault(report.key, report)  # a newer one stands
                else:
                    for report in reports:
                        log.info("destination %s is throttling: %s", report.key, report.reply)
            holds, self._holds = self._holds, {}
            if holds:
                try:
                    await suspensions.hold(self.pool, holds)
                except DB_ERRORS as exc:
                    refused = True
                    log.warning("cannot store suspensions replies asked for (will retry): %s", exc)
                    for key, (seconds, reason) in holds.items():
                        self._add_hold(key, seconds, reason)
                else:
                    for key, (seconds, reason) in holds.items():
                        log.info("%s suspended for %g s: %s", key, seconds, reason)
            limits, self._limits = list(self._limits.values()), {}
            if limits:
                try:
                    await store.limit_budgets(self.pool, limits)
                except DB_ERRORS as exc:
                    refused = True
                    log.warning("cannot store reply rules' limits (will retry): %s", exc)
                    for limit in limits:
                        self._add_limit(limit)
                else:
                    for limit in limits:
                        log.info("%s limited for %g s: %s", limit.key, limit.seconds, limit.reason)
            wait = min(RETRY_MAX, max(0.1, wait * 2)) if refused else REPORT_WINDOW

    async def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reporter


def _lower(a: float, b: float) -> float:
    """The lower of two limits, where 0 sets none."""
    return min(a, b) if a > 0 and b > 0 else max(a, b)
