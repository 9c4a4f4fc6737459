"""Per-destination policy and this process's concurrency limit per destination (its rates are the
cluster's budgets', outbound/budgets.py).

A destination is what a `[delivery.destination."PATTERN"]` entry groups (a domain, or every domain
whose MX hosts match a pattern such as "*.google.com"), else the route's site (`Route.site`: the
set of MX hosts, so that domains hosted at one provider share its limits; a static route or the
relayhost). Traffic is shaped by the site that receives it, not by the recipient's domain name.
An entry's rate and concurrency hold for the whole cluster (outbound/budgets.py); the Gates here
hold every destination's per-process, adaptive `destination_concurrency` besides.
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pigeon_mta.config import DeliverySettings, DestinationSettings, TlsPolicy
from pigeon_mta.domains import routing_domain
from pigeon_mta.outbound import adaptive
from pigeon_mta.outbound.adaptive import AimdPolicy
from pigeon_mta.outbound.mx import Route
from pigeon_mta.store.budgets import DEFAULT_SOURCE, site_budget_key


@dataclass(frozen=True)
class DestinationPolicy:
    site: str  # everything at the same site shares one concurrency limit and one budget
    tls: TlsPolicy
    concurrency: int  # per process (adaptive), whatever cluster budget applies too
    rate: float  # messages per second for the whole cluster; 0 means unlimited
    burst: int
    # Sessions at once for the whole cluster, when the entry sets a concurrency (0: none; the
    # per-process `concurrency` applies instead).
    cluster_concurrency: int
    max_messages_per_connection: int
    # The egress source it leaves from (store/budgets.py): its budget is the (source, site)'s.
    source: str = DEFAULT_SOURCE

    @property
    def budget_key(self) -> str:
        """The cluster budget of this (source, site): rates, sessions, backoff, parking and
        suspensions are kept under it."""
        return site_budget_key(self.source, self.site)


def policy_for(delivery: DeliverySettings, domain: str, route: Route) -> DestinationPolicy:
    """The policy of the most specific `[delivery.destination]` entry that matches, else defaults.

    An exact domain wins; then the longest pattern matching the domain; then the longest pattern
    matching one of the route's host names.
    """
    domain = routing_domain(domain)
    chosen: tuple[str, DestinationSettings] | None = None
    entries = {pattern.lower(): dest for pattern, dest in delivery.destination.items()}
    if domain in entries:
        chosen = (domain, entries[domain])
    else:
        for names in ((domain,), route.host_names):
            matches = [
                pattern
                for pattern in entries
                if any(fnmatch.fnmatchcase(name.lower(), pattern) for name in names)
            ]
            if matches:
                best = max(matches, key=len)
                chosen = (best, entries[best])
                break
    dest = chosen[1] if chosen else DestinationSettings()
    # The relayhost's own TLS setting wins; else the entry's, else delivery.tls.
    tls: TlsPolicy = route.tls if route.tls is not None else (dest.tls or delivery.tls)
    return DestinationPolicy(
        site=f"pattern:{chosen[0]}" if chosen else route.site,
        tls=tls,
        concurrency=dest.concurrency or delivery.destination_concurrency,
        rate=dest.rate,
        burst=dest.burst or max(1, int(dest.rate)),
        max_messages_per_connection=dest.max_messages_per_connection
        or delivery.max_messages_per_connection,
        cluster_concurrency=dest.concurrency,
    )


class Gate:
    """A destination's per-process concurrency limit (adaptive, outbound/adaptive.py, when the
    settings ask for it), with the transactions waiting for a slot. Its rates are the cluster's
    budgets' (outbound/budgets.py)."""

    def __init__(self, policy: DestinationPolicy, aimd: AimdPolicy | None) -> None:
        self.policy = policy
        self.aimd = aimd
        self.state = adaptive.start(aimd) if aimd is not None else None
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def limit(self) -> int:
        """Transactions this destination may have in flight now."""
        return self.state.concurrency if self.state is not None else self.policy.concurrency

    @property
    def waiting(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    async def acquire(self, timeout: float) -> bool:
        """Take a slot within `timeout` seconds; False if none came."""
        if self.in_flight < self.limit and not self.waiting:
            self.in_flight += 1
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        except asyncio.CancelledError:
            # Cancelled while waiting (the engine stopping): a slot handed over meanwhile goes
            # back, else the waiter is withdrawn; either way no slot stays taken.
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                waiter.cancel()
            raise
        if waiter.done() and not waiter.cancelled():
            return True  # the slot was handed over (see _wake)
        waiter.cancel()
        return False

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def report(self, outcome: TransactionOutcome, seconds: float, now: float) -> None:
        """How a transaction to this destination went: the adaptive limit follows it."""
        if self.aimd is None or self.state is None:
            return
        if outcome == "throttled":
            self.state = adaptive.after_throttling(self.state, self.aimd, now)
        elif outcome == "connection-error":
            self.state = adaptive.after_connection_error(self.state, self.aimd, now)
        else:
            self.state = adaptive.after_healthy_reply(self.state, self.aimd, now, seconds)
            self._wake()

    def _wake(self) -> None:
        """Hand free slots to the longest waiting, each slot taken for the waiter it wakes."""
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)


# How a transaction went, for a destination's adaptive concurrency: a throttling reply
# (classified rate-limited), a connection that failed or broke, or anything else (a reply).
TransactionOutcome = Literal["healthy", "throttled", "connection-error"]

# Gates kept before idle ones are forgotten.
MAX_IDLE_GATES = 10000

# A destination whose limit is full keeps at most this many transactions per slot waiting in the
# engine; more are handed back to the queue at once, so that one busy destination cannot take the
# engine's room (delivery.concurrency) from the others.
WAITING_PER_SLOT = 2
# ... due again this many seconds later: the destination is busy, not refusing.
BUSY_RETRY = 1.0


def _limits(policy: DestinationPolicy) -> tuple[int, float, int]:
    return policy.concurrency, policy.rate, policy.burst


class Gates:
    """One Gate per destination key, made on first use (and rebuilt if its policy changed).

    `initial`: the limit an adaptive gate starts with (0: fixed limits, policy.concurrency)."""

    def __init__(self, *, initial: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self._gates: dict[str, Gate] = {}
        self.initial = initial
        self.clock = clock

    def get(self, policy: DestinationPolicy) -> Gate:
        gate = self._gates.get(policy.site)
        if gate is None or _limits(gate.policy) != _limits(policy):
            if len(self._gates) >= MAX_IDLE_GATES:
                self._forget_idle()
            aimd = None
            if self.initial:
                aimd = AimdPolicy(
                    maximum=policy.concurrency, initial=min(self.initial, policy.concurrency)
                )
            gate = Gate(policy, aimd)
            self._gates[policy.site] = gate
        return gate

    def _forget_idle(self) -> None:
        """Drop gates nobody is using (one per destination ever seen would only grow). A
        forgotten adaptive limit starts again from `initial`."""
        for key, gate in list(self._gates.items()):
            if gate.in_flight == 0 and not gate.waiting:
                del self._gates[key]

    async def enter(self, policy: DestinationPolicy, max_wait: float) -> Gate | float:
        """Wait for a slot; returns the Gate (call `leave`), or, when that would take
        longer than `max_wait` or too many wait already, the seconds after which the destination
        should have room."""
        gate = self.get(policy)
        if gate.waiting >= WAITING_PER_SLOT * gate.limit:
            return BUSY_RETRY
        if not await gate.acquire(max_wait):
            return max(1.0, max_wait)
        return gate

    def leave(
        self, gate: Gate, outcome: TransactionOutcome | None = None, seconds: float = 0.0
    ) -> None:
        """The transaction ended (`outcome` None: it never reached the destination)."""
        if outcome is not None:
            gate.report(outcome, seconds, self.clock())
        gate.release()
