"""The engine's side of the cluster's budgets: grants kept in memory, asked for in batches.

A delivery needs a token of each budget it falls under (its destination's, its lane's, its org's:
store/budgets.py) and, for a destination with a concurrency, a session slot while its transaction
runs. This process keeps what it was granted; what it lacks, the deliveries that reach their
budgets at about the same moment ask for together, in one statement. A delivery that gets no
grant is not kept waiting (it would hold one of the engine's slots while other destinations have
work): it is handed back, due when its budget should have room, the due times of a batch a token
apart. Slots are kept a moment after use (the next message reuses their pooled connection) and
then given back, with the idle connections they stood for closed first: a pooled connection is a
session at the destination. Destinations without a budget cost nothing here: no statement at all.

A throttling reply (classified rate-limited) makes the destination's budget one this process asks
for, also when it has no configured limit (outbound/throttling.py reports it for the cluster); a
retry delay it states holds the site for the org whose mail got it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.metrics import BUDGET_POSTPONED, BUDGETS_BACKING_OFF
from pigeon_mta.model import Delivery, Reply
from pigeon_mta.node import STALE_AFTER
from pigeon_mta.outbound.connect import ConnectionKey
from pigeon_mta.outbound.grants import Held, Need, Pass, Wait, name_of, wait_for
from pigeon_mta.outbound.holds import Suspended
from pigeon_mta.outbound.limits import DestinationPolicy
from pigeon_mta.outbound.parking import SiteHealth
from pigeon_mta.outbound.pool import ConnectionPool
from pigeon_mta.outbound.shaping import Action
from pigeon_mta.outbound.throttling import ThrottlingReports
from pigeon_mta.store import budgets as store
from pigeon_mta.store.budgets import LANE, ORG, GrantRequest
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.suspensions import hold_key

log = logging.getLogger(__name__)

# How often the orgs with a rate and the budgets backing off are read again (while mail flows).
REFRESH_INTERVAL = 1.0
# Requests that arrive within this window share one statement.
BATCH_WINDOW = 0.005
# A token granted for a delivery that another budget then refused is kept this long for the next.
SPARE_TOKEN_TTL = 1.0
# An unused slot is given back after this long (and its idle connections closed).
SLOT_LINGER = 0.5
# How far ahead mail handed back for want of tokens is booked at most.
BOOKING_HORIZON = 60.0
# Due time of mail handed back when the budgets cannot be read (the database away).
UNAVAILABLE_DELAY = 5.0


@dataclass
class _Request:
    needs: tuple[Need, ...]
    done: asyncio.Future[Pass | Wait]


class Budgets:
    """This process's grants of the cluster's budgets; `admit` a delivery, `leave` when done."""

    def __init__(
        self, settings: Settings, pool: asyncpg.Pool, connections: ConnectionPool, owner: str
    ) -> None:
        self.settings = settings
        self.delivery = settings.delivery
        self.pool = pool
        self.connections = connections
        # Processes of one node share its lease owner: each holds its own slots.
        self.holder = f"{owner}#{os.getpid()}"
        self._held: dict[str, Held] = {}
        self.throttling = ThrottlingReports(settings, pool, self.holder)
        self.suspended = Suspended(self.throttling)
        self.health = SiteHealth(settings, pool)
        self._parked: frozenset[str] = frozenset()
        self._capped: frozenset[str] = frozenset()
        self._org_rates: dict[uuid.UUID, float] = {}
        self._backing_off: frozenset[str] = frozenset()
        self._refreshed = -REFRESH_INTERVAL
        self._read_once = False
        self._refresh: asyncio.Task[None] | None = None
        self._pending: list[_Request] = []
        self._flusher: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._slot_lock = asyncio.Lock()

    # ------------------------------------------------------------ which budgets

    def needs(self, delivery: Delivery, policy: DestinationPolicy) -> tuple[Need, ...]:
        self._refresh_soon()
        needs: list[Need] = []
        key = policy.budget_key
        configured = policy.rate > 0 or policy.cluster_concurrency > 0
        held_back = key in self._backing_off or key in self._capped
        if configured or held_back or key in self._parked:
            needs.append(
                Need(
                    key,
                    policy.rate,
                    policy.cluster_concurrency,
                    float(policy.burst),
                    slot=policy.cluster_concurrency > 0 or held_back,
                    label=key if configured else "destination",
                    prepaid=delivery.site == key,
                )
            )
        lane = self.settings.lanes.get(delivery.lane)
        if lane is not None and lane.rate > 0:
            rate = lane.rate
            needs.append(Need(LANE + delivery.lane, rate, 0, max(1.0, rate), False, "lane"))
        org_rate = self._org_rates.get(delivery.org_id, 0.0)
        if org_rate > 0:
            needs.append(
                Need(ORG + str(delivery.org_id), org_rate, 0, max(1.0, org_rate), False, "org")
            )
        return tuple(needs)

    async def suspension(
        self, delivery: Delivery, policy: DestinationPolicy
    ) -> tuple[str | None, str] | None:
        """The suspension that holds this delivery, if any (outbound/holds.py)."""
        self._refresh_soon()
        if not self._read_once and self._refresh is not None:
            await asyncio.shield(self._refresh)
        return self.suspended.find(delivery, policy)

    # ------------------------------------------------------------ admit / leave

    async def admit(self, delivery: Delivery, policy: DestinationPolicy) -> Pass | Wait | None:
        """A Pass (call `leave`), a Wait (hand the delivery back), or None: no budget applies
        (the common case, mail to a destination without a budget, costs a few look-ups)."""
        needs = self.needs(delivery, policy)
        if not self._read_once and self._refresh is not None:
            # The orgs' rates are not known before the first read.
            await asyncio.shield(self._refresh)
            needs = self.needs(delivery, policy)
        if not needs:
            return None
        loop = asyncio.get_running_loop()
        if self._take_local(needs, loop.time()):
            return Pass(needs)
        request = _Request(needs, loop.create_future())
        self._pending.append(request)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="budget-grants")
        result = await request.done
        if isinstance(result, Wait):
            BUDGET_POSTPONED.labels(budget=result.need.label, reason=result.kind).inc()
            self.refund(needs)
        return result

    def refund(self, needs: Iterable[Need]) -> None:
        """A token the claim took for a delivery that then waits (for another budget, a
        suspension, the process's own concurrency) is this process's spare for the next one."""
        now = asyncio.get_running_loop().time()
        for need in needs:
            if need.prepaid:
                held = self._held.setdefault(need.key, Held())
                if held.tokens_until < now:
                    held.tokens = 0
                held.tokens += 1
                held.tokens_until = now + SPARE_TOKEN_TTL

    def leave(self, passed: Pass, connection: ConnectionKey | None) -> None:
        """The delivery's transaction is over; its slots stay held a moment for the next one."""
        now = asyncio.get_running_loop().time()
        for need in passed.needs:
            held = self._held.get(need.key)
            if need.slot and held is not None:
                held.in_use -= 1
                held.last_used = now
                if connection is not None:
                    held.connections.add(connection)

    def _take_local(self, needs: Iterable[Need], now: float) -> bool:
        """Take a token of each need and a slot of those with one, all or nothing."""
        helds = []
        for need in needs:
            if need.prepaid and not need.slot:
                continue
            held = self._held.get(need.key)
            if held is None:
                return False
            if held.tokens_until < now:
                held.tokens = 0
            if (held.tokens < 1 and not need.prepaid) or (need.slot and not self._slot_free(held)):
                return False
            helds.append((need, held))
        for need, held in helds:
            if not need.prepaid:
                held.tokens -= 1
            if need.slot:
                held.in_use += 1
        return True

    @staticmethod
    def _slot_free(held: Held) -> bool:
        return not held.slots_limited or held.in_use < held.slots

    # ------------------------------------------------------------ one statement per batch

    async def _flush(self) -> None:
        while self._pending:
            await asyncio.sleep(BATCH_WINDOW)
            batch, self._pending = self._pending, []
            try:
                await self._grant(batch)
            except Exception as exc:
                if not isinstance(exc, DB_ERRORS):
                    log.exception("budget grants failed unexpectedly")
                else:
                    log.warning("cannot take budget grants: %s", exc)
                until = datetime.now(UTC) + timedelta(seconds=UNAVAILABLE_DELAY)
                for request in batch:
                    if not request.done.done():
                        need = request.needs[0]
                        reason = f"postponed: the budget of {name_of(need)} cannot be read"
                        request.done.set_result(Wait(until, reason, need, "unavailable"))

    async def _grant(self, batch: list[_Request]) -> None:
        # Slots change in the database only under this lock, so that it and this process agree
        # on what is held.
        async with self._slot_lock:
            await self._grant_locked(batch)

    async def _grant_locked(self, batch: list[_Request]) -> None:
        now = asyncio.get_running_loop().time()
        wanted: dict[str, list[int]] = {}
        needs: dict[str, Need] = {}
        for request in batch:
            for need in request.needs:
                counts = wanted.setdefault(need.key, [0, 0])
                counts[0] += int(not need.prepaid)
                counts[1] += int(need.slot)
                needs[need.key] = need
        requests = []
        for key, (tokens, slots) in wanted.items():
            held = self._held.setdefault(key, Held())
            spare = held.tokens if held.tokens_until >= now else 0
            free = max(0, held.slots - held.in_use)
            need = needs[key]
            requests.append(
                GrantRequest(
                    key,
                    need.rate,
                    need.concurrency,
                    need.burst,
                    max(0, tokens - spare),
                    max(0, slots - free) if need.slot else 0,
                )
            )
        grants = await store.take_grants(
            self.pool,
            requests,
            holder=self.holder,
            lease=self.delivery.lease,
            horizon=BOOKING_HORIZON,
            stale=STALE_AFTER,
        )
        for key, grant in grants.items():
            held = self._held[key]
            if held.tokens_until < now:
                held.tokens = 0
            held.tokens += grant.tokens
            held.tokens_until = now + SPARE_TOKEN_TTL
            held.slots = grant.held
            held.slots_limited = grant.effective_concurrency > 0
            held.effective_rate = grant.effective_rate
            held.effective_concurrency = grant.effective_concurrency
            held.held_until = grant.held_until
            held.parked_until = grant.parked_until
            if held.booked_from != grant.booked_from:
                held.booked_from, held.booked = grant.booked_from, 0
            held.slot_waits = 0
        for request in batch:
            if request.done.done():  # its delivery was cancelled (a stop): it takes nothing
                continue
            if self._take_local(request.needs, now):
                request.done.set_result(Pass(request.needs))
            else:
                request.done.set_result(self._wait(request.needs, now))

    def _wait(self, needs: tuple[Need, ...], now: float) -> Wait:
        """When the delivery should find room: the latest of its budgets' answers."""
        waits = []
        for need in needs:
            held = self._held[need.key]
            backing_off = need.key in self._backing_off or (
                held.effective_rate > 0 and need.rate > 0 and held.effective_rate < need.rate
            )
            free = not need.slot or self._slot_free(held)
            wait = wait_for(need, held, backing_off=backing_off, slot_free=free)
            if wait is not None:
                waits.append(wait)
        if not waits:  # every budget had room, yet not all at once: a moment later
            until = datetime.now(UTC) + timedelta(seconds=SLOT_LINGER)
            return Wait(until, f"postponed: waiting for {name_of(needs[0])}", needs[0], "rate")
        return max(waits, key=lambda w: w.until)

    # ------------------------------------------------------------ what is in force

    def _refresh_soon(self) -> None:
        now = time.monotonic()
        if now - self._refreshed < REFRESH_INTERVAL:
            return
        if self._refresh is not None and not self._refresh.done():
            return
        self._refreshed = now
        self._refresh = asyncio.create_task(self._read_in_force(), name="budget-refresh")
        if self._keeper is None:
            self._keeper = asyncio.create_task(self._keep_slots(), name="budget-slots")

    async def _read_in_force(self) -> None:
        try:
            in_force = await store.budgets_in_force(
                self.pool, step=self.delivery.backoff_step, quiet=self.delivery.backoff_quiet
            )
        except Exception as exc:
            if not isinstance(exc, DB_ERRORS):
                log.exception("reading the budgets in force failed unexpectedly")
            else:
                log.warning("cannot read the budgets in force: %s", exc)
            return
        self._read_once = True
        self._org_rates = dict(in_force.org_rates)
        self._backing_off = in_force.backing_off
        self._parked = in_force.parked
        self._capped = in_force.capped
        self.suspended.notes = in_force.suspended
        self.health.failing |= in_force.parked
        BUDGETS_BACKING_OFF.set(len(in_force.backing_off))

    # ------------------------------------------------------------ throttling

    def throttled(
        self, policy: DestinationPolicy, reply: Reply, retry_after: float, org_id: uuid.UUID
    ) -> None:
        """A throttling reply from this destination: reported for the cluster; from now on this
        process takes the destination's grants from the database. A retry delay it states
        holds the site for `org_id`'s mail."""
        self.throttling.throttled(policy, reply)
        self._backing_off = self._backing_off | {policy.budget_key}
        if retry_after > 0:
            reason = f"the destination asked to retry in {retry_after:g} s ({reply})"
            self.suspended.hold(hold_key(policy.budget_key, org_id), retry_after, reason)

    def shaped(self, policy: DestinationPolicy, actions: Iterable[Action]) -> None:
        """What reply rules (outbound/shaping.py) decided for this destination, for the cluster."""
        site = policy.budget_key
        for action in actions:
            rule = action.rule
            if rule.action == "suspend":
                key = hold_key(site, action.org_id) if rule.scope == "org" else site
                self.suspended.hold(key, rule.duration, action.reason)
            else:
                rate = rule.value if rule.action == "rate" else 0.0
                sessions = int(rule.value) if rule.action == "sessions" else 0
                self.throttling.limit(site, rate, sessions, rule.duration, action.reason)
                self._backing_off = self._backing_off | {site}

    # ------------------------------------------------------------ slots given back

    async def _keep_slots(self) -> None:
        """Give back slots unused for SLOT_LINGER (their idle connections closed first) and
        renew the lease of the rest every third of a lease."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(SLOT_LINGER / 2)
            renew = time.monotonic() - renewed >= self.delivery.lease / 3
            try:
                if await self._give_back_idle_slots(renew=renew) and renew:
                    renewed = time.monotonic()
            except Exception:
                log.exception("budget slots: giving back or renewing failed unexpectedly")

    async def _give_back_idle_slots(self, *, renew: bool) -> bool:
        now = asyncio.get_running_loop().time()
        unused = []
        for key, held in self._held.items():
            idle = held.slots > held.in_use and now - held.last_used >= SLOT_LINGER
            if idle and held.slots_limited:
                # None of them can be taken from now on; the sessions they stood for end first.
                held.slots = held.in_use
                unused.append(key)
        await self._close_idle(unused)
        async with self._slot_lock:
            # What is held now: a grant meanwhile may have added slots (the database has them).
            keep = {
                key: held.slots
                for key, held in self._held.items()
                if key in unused or (renew and held.slots)
            }
            if not keep:
                return True
            try:
                allowed = await store.hold_slots(
                    self.pool, keep, holder=self.holder, lease=self.delivery.lease
                )
            except DB_ERRORS as exc:
                log.warning("cannot give back or renew budget slots: %s", exc)
                return False
            for key, count in keep.items():
                held = self._held[key]
                held.slots = min(held.slots, allowed.get(key, 0)) if count else 0
        return True

    async def _close_idle(self, keys: Iterable[str]) -> None:
        """Close the idle connections beyond the free slots each budget still holds."""
        for key in keys:
            held = self._held[key]
            if held.connections:
                await self.connections.close_idle(held.connections, keep=held.slots - held.in_use)

    async def close(self) -> None:
        """Give every slot back (at stop; a killed process's slots lapse with their lease)."""
        await self.throttling.close()
        await self.health.close()
        for task in (self._keeper, self._flusher, self._refresh):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        keep = {key: 0 for key, held in self._held.items() if held.slots}
        if keep:
            with contextlib.suppress(*DB_ERRORS):
                await store.hold_slots(
                    self.pool, keep, holder=self.holder, lease=self.delivery.lease
                )
