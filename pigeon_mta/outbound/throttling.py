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
import dataclasses
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
from pigeon_mta.store.errors import is_about_the_values

log = logging.getLogger(__name__)

# Throttling replies within this many seconds of a decrease are the same overload.
DECREASE_HOLD = 1.0
# Replies that arrive within this window share one statement.
REPORT_WINDOW = 0.005
# A report the database refused is tried again, after a wait that doubles up to this.
RETRY_MAX = 5.0
# A throttling reply not reported within this many seconds is dropped, not reported late.
STALE_REPORT = 10.0
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
        # Each waits for the reporter with when it was seen (monotonic), or when it ends.
        self._reports: dict[str, tuple[Throttling, float]] = {}
        self._holds: dict[str, tuple[float, str]] = {}  # hold key: (until, reason)
        self._limits: dict[str, tuple[Limit, float]] = {}  # site key: (limit, until)
        self._reporter: asyncio.Task[None] | None = None

    def sending(self, policy: DestinationPolicy) -> None:
        """A transaction to this destination starts."""
        traffic = self._traffic.get(policy.site)
        if traffic is None:
            if len(self._traffic) >= MAX_TRAFFIC_KEYS:
                self._traffic = {k: t for k, t in self._traffic.items() if t.in_flight}
            traffic = self._traffic[policy.site] = _Traffic(window_start=time.monotonic())
        traffic.in_flight += 1
        traffic.sent(time.monotonic())

    def sent(self, policy: DestinationPolicy) -> None:
        """A transaction to this destination is over."""
        traffic = self._traffic.get(policy.site)
        if traffic is not None:
            traffic.in_flight -= 1

    def throttled(self, policy: DestinationPolicy, reply: Reply) -> None:
        """Report a throttling reply from this destination (in a batch, at once)."""
        key = policy.budget_key
        configured = policy.rate > 0 or policy.cluster_concurrency > 0
        DESTINATION_THROTTLING.labels(destination=key if configured else "other").inc()
        traffic = self._traffic.get(policy.site) or _Traffic()
        earlier = self._reports.get(key, (None, 0.0))[0]
        report = Throttling(
            key,
            self.holder,
            max(traffic.rate, float(traffic.count), earlier.rate if earlier else 1.0),
            max(traffic.in_flight, earlier.concurrency if earlier else 1),
            plain_text(str(reply), MAX_REASON),
        )
        self._reports[key] = (report, time.monotonic())
        self._report_soon()

    def hold(self, key: str, seconds: float, reason: str) -> None:
        """Report a suspension a reply asked for: a site's for one org (`suspensions.hold_key`)
        or a site's for all."""
        # The reason quotes the destination's reply: plain and bounded, storable whatever bytes
        # the reply held.
        self._add_hold(key, time.monotonic() + seconds, plain_text(reason, MAX_REASON))
        self._report_soon()

    def _add_hold(self, key: str, until: float, reason: str) -> None:
        earlier = self._holds.get(key)
        if earlier is None or until > earlier[0]:
            self._holds[key] = (until, reason)

    def limit(self, key: str, rate: float, sessions: int, seconds: float, reason: str) -> None:
        """Report a reply rule's limit of a site's rate or sessions (0: unchanged), for
        `seconds`."""
        limit = Limit(key, rate, sessions, seconds, plain_text(reason, MAX_REASON))
        self._add_limit(limit, time.monotonic() + seconds)
        self._report_soon()

    def _add_limit(self, limit: Limit, until: float) -> None:
        """Two limits of one site before a report are one: the lower rate and sessions (of
        those each sets), the later end."""
        earlier = self._limits.get(limit.key)
        if earlier is not None:
            until = max(until, earlier[1])
            limit = Limit(
                limit.key,
                _lower(earlier[0].rate, limit.rate),
                int(_lower(earlier[0].sessions, limit.sessions)),
                limit.seconds,
                limit.reason,
            )
        self._limits[limit.key] = (limit, until)

    def _report_soon(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report(), name="budget-throttling")

    async def _report(self) -> None:
        """Report what waits, each kind in its own statement. What the database refused for an
        outage is kept (merged with what came since) and tried again after a growing wait, so
        that an outage loses no hold or limit: each is sent for the time it has left, and a
        throttling reply older than STALE_REPORT is dropped (the site may have recovered since).
        What it refused for its values is dropped, with an error in the log."""
        wait = REPORT_WINDOW
        while self._reports or self._holds or self._limits:
            await asyncio.sleep(wait)
            now = time.monotonic()
            refused = False
            waiting, self._reports = self._reports, {}
            reports = [r for r, seen in waiting.values() if now - seen <= STALE_REPORT]
            if reports:
                try:
                    await store.report_throttling(
                        self.pool, reports, factor=self.delivery.backoff_factor, hold=DECREASE_HOLD
                    )
                except DB_ERRORS as exc:
                    if _kept(exc, "throttling replies"):
                        refused = True
                        for key, item in waiting.items():
                            self._reports.setdefault(key, item)  # a newer one stands
                else:
                    for report in reports:
                        log.info("destination %s is throttling: %s", report.key, report.reply)
            holds, self._holds = self._holds, {}
            due = {k: (until - now, reason) for k, (until, reason) in holds.items() if until > now}
            if due:
                try:
                    await suspensions.hold(self.pool, due)
                except DB_ERRORS as exc:
                    if _kept(exc, "suspensions replies asked for"):
                        refused = True
                        for key, (until, reason) in holds.items():
                            self._add_hold(key, until, reason)
                else:
                    for key, (seconds, reason) in due.items():
                        log.info("%s suspended for %g s: %s", key, seconds, reason)
            limits, self._limits = self._limits, {}
            left = [
                dataclasses.replace(limit, seconds=until - now)
                for limit, until in limits.values()
                if until > now
            ]
            if left:
                try:
                    await store.limit_budgets(self.pool, left)
                except DB_ERRORS as exc:
                    if _kept(exc, "reply rules' limits"):
                        refused = True
                        for limit, until in limits.values():
                            self._add_limit(limit, until)
                else:
                    for limit in left:
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


def _kept(exc: BaseException, what: str) -> bool:
    """Whether what the database refused is to be tried again: yes for an outage; no for
    values it refuses, which it would refuse for ever."""
    if is_about_the_values(exc):
        log.error("cannot store %s, dropped: the database refuses them: %s", what, exc)
        return False
    log.warning("cannot store %s (will retry): %s", what, exc)
    return True
