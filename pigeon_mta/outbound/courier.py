"""One delivery: route -> the destination's limits -> sign -> one SMTP transaction -> judged results.

`Courier.deliver` answers with values: each recipient's AttemptResult, or `Postponed` when the
destination has no room now. Nothing escapes it but cancellation: an unexpected error defers the
recipients (a bug must not lose mail) and is logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pigeon_mta.config import Settings, TlsPolicy
from pigeon_mta.metrics import ACCEPT_TO_DELIVERY_SECONDS, DELIVERY_ATTEMPT_SECONDS
from pigeon_mta.model import AttemptResult, Delivery, Outcome, Reply, Signed
from pigeon_mta.outbound import shaping
from pigeon_mta.outbound.attempt import (
    Peer,
    RecipientResult,
    TransactionResult,
    not_connected,
    transact,
    wire_message,
)
from pigeon_mta.outbound.budgets import Budgets
from pigeon_mta.outbound.classify import is_connection_failure, stated_retry_delay, throttling_reply
from pigeon_mta.outbound.connect import ConnectionKey, ConnectOptions
from pigeon_mta.outbound.grants import Pass, Wait
from pigeon_mta.outbound.limits import (
    DestinationPolicy,
    Gate,
    Gates,
    TransactionOutcome,
    policy_for,
)
from pigeon_mta.outbound.mx import Route, RouteFailure, Router
from pigeon_mta.outbound.outcome import judge
from pigeon_mta.outbound.pool import ConnectionPool, NotConnected
from pigeon_mta.signer import KeysUnavailable
from pigeon_mta.store.budgets import DESTINATION

log = logging.getLogger(__name__)

Signer = Callable[[Delivery], Awaitable[Signed]]


async def unsigned(delivery: Delivery) -> Signed:
    """The default sign step: the body as queued (the DKIM signer replaces it)."""
    return Signed(delivery.body)


# The peer of results that never reached one.
NO_PEER = Peer(None, None, None)


@dataclass(frozen=True)
class Postponed:
    """The destination had no room: its recipients go back to the queue, unattempted, until;
    `reason` is what their log shows."""

    until: datetime
    reason: str = "postponed: its destination had no room"
    # The budget key of the site whose queue the recipients join (waiting for its rate), if any.
    site: str | None = None


class Courier:
    """Delivers one Delivery at a time (many at once), over connections pooled per host."""

    def __init__(
        self,
        settings: Settings,
        *,
        sign: Signer,
        router: Router,
        rng: random.Random,
        on_data_sent: Callable[[Iterable[uuid.UUID]], None],
        budgets: Callable[[ConnectionPool], Budgets],
    ) -> None:
        self.delivery = settings.delivery
        self.max_age_of = settings.max_age_of
        self.sign = sign
        self.router = router
        self.rng = rng
        self.on_data_sent = on_data_sent
        self.connections = ConnectionPool(
            ConnectOptions.from_settings(settings.server.hostname, settings.delivery),
            max_per_host=settings.delivery.max_connections_per_host,
            idle_timeout=settings.delivery.idle_timeout,
        )
        # Each destination's limit per process adapts to its replies (outbound/adaptive.py),
        # between 1 and its concurrency, from destination_concurrency_initial.
        self.gates = Gates(
            initial=settings.delivery.destination_concurrency_initial
            if settings.delivery.adaptive_concurrency
            else 0
        )
        self.rules = shaping.compile_rules(settings.shaping)
        # The cluster's budgets: rates, sessions, suspensions (outbound/budgets.py).
        self.budgets = budgets(self.connections)

    async def deliver(
        self, delivery: Delivery, *, sending: Callable[[], None]
    ) -> list[AttemptResult] | Postponed:
        """The results of one delivery; `sending` is called once it passed its destination's
        limits, when its SMTP transaction begins."""
        started_at = datetime.now(UTC)
        try:
            return await self._deliver(delivery, started_at, sending)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, KeysUnavailable):
                # The database is away (a restart, a failover): a temporary local failure, and
                # expected, so no traceback.
                log.warning("message %s deferred: %s", delivery.queue_id, exc)
            else:
                # A bug must not lose mail: the recipients are deferred and the error logged.
                log.exception("delivery of message %s failed unexpectedly", delivery.queue_id)
            return self._judge(
                delivery,
                [RecipientResult(r, "connect", exc) for r in delivery.recipients],
                started_at,
            )

    async def _deliver(
        self, delivery: Delivery, started_at: datetime, sending: Callable[[], None]
    ) -> list[AttemptResult] | Postponed:
        if delivery.site_delay > 0:
            # Claimed from its site's queue with the token of a moment from now.
            await asyncio.sleep(delivery.site_delay)
        route = await self.router.route(delivery.domain)
        if isinstance(route, RouteFailure):
            return self._judge(
                delivery,
                [RecipientResult(r, "route", route.reply) for r in delivery.recipients],
                started_at,
            )
        policy = policy_for(self.delivery, delivery.domain, route)
        if delivery.site and delivery.site.startswith(DESTINATION):
            if delivery.site != policy.budget_key:
                # Its site's queue is not where this mail goes now: that site is not left
                # parked for mail that no longer reaches it.
                self.budgets.health.moved(delivery.site)
        entered = await self._enter(delivery, policy)
        if isinstance(entered, Postponed):
            return entered
        passed, gate = entered
        budgets = self.budgets
        sending()
        budgets.throttling.sending(policy)
        connection: list[ConnectionKey] = []
        tx: TransactionResult | None = None
        try:
            signed = await self.sign(delivery)
            tx = await self._transaction(
                delivery,
                signed.body,
                route,
                policy.tls,
                policy.max_messages_per_connection,
                connection,
            )
        finally:
            budgets.throttling.sent(policy)
            if passed is not None:
                budgets.leave(passed, connection[-1] if connection else None)
            if gate is not None and tx is None:
                self.gates.leave(gate)
        DELIVERY_ATTEMPT_SECONDS.observe(tx.duration)
        # Started so that start + duration is when the final reply came (attempt.py).
        tx_started_at = tx.finished_at - timedelta(seconds=tx.duration)
        outcome: TransactionOutcome | None = None
        try:
            results = self._judge(
                delivery, tx.results, tx_started_at, tx.peer, tx.duration, dkim=signed.dkim
            )
            results, actions = shaping.apply(
                results, self.rules, policy.site, datetime.now(UTC), self._expiries(delivery)
            )
            throttled = throttling_reply(results)
            outcome = transaction_outcome(tx, throttled)
        finally:
            if gate is not None:
                self.gates.leave(gate, outcome, tx.duration)
        if actions:
            budgets.shaped(policy, actions)
        if throttled is not None:
            # It lowers the destination's budget for the whole cluster.
            delay = stated_retry_delay(throttled.text) or 0.0
            budgets.throttled(policy, throttled, delay, delivery.org_id)
        if outcome == "connection-error":
            budgets.health.failed(policy.budget_key, results[0].reply.text if results else "")
        else:
            budgets.health.healthy(policy.budget_key)
        return results

    async def _enter(
        self, delivery: Delivery, policy: DestinationPolicy
    ) -> tuple[Pass | None, Gate | None] | Postponed:
        """Pass the destination's limits: the cluster's budgets that apply, then this process's
        own concurrency limit (adaptive), which always applies: a budget's rate says how many
        messages a second, not how many sessions at once. The rates are the budgets' alone."""
        budgets = self.budgets
        held = await budgets.suspension(delivery, policy)
        if held is not None:
            queue, note = held
            budgets.refund(budgets.needs(delivery, policy))
            return Postponed(datetime.now(UTC), note, queue)
        passed = await budgets.admit(delivery, policy)
        if isinstance(passed, Wait):
            return Postponed(passed.until, passed.reason, passed.site)
        entered = await self.gates.enter(policy, self.delivery.throttle_wait)
        if isinstance(entered, Gate):
            return passed, entered
        if passed is not None:
            budgets.leave(passed, None)
            budgets.refund(passed.needs)
        wait = entered * self.rng.uniform(1.0, 1.2)
        return Postponed(datetime.now(UTC) + timedelta(seconds=wait))

    async def _transaction(
        self,
        delivery: Delivery,
        body: bytes,
        route: Route,
        tls: TlsPolicy,
        max_messages: int,
        used: list[ConnectionKey],
    ) -> TransactionResult:
        """One transaction over a pooled connection; `used` gets the key of each connection."""
        message = wire_message(body)
        started = asyncio.get_running_loop().time()
        for _ in range(2):
            connected = await self.connections.connect(route, tls, self.router)
            if isinstance(connected, NotConnected):
                return not_connected(delivery.recipients, connected, started)
            reusable = False  # unless the transaction says so: an error escaping it breaks it
            used.append(connected.connection.key)
            try:
                tx = await transact(
                    connected,
                    sender=delivery.mail_from or delivery.sender,
                    recipients=delivery.recipients,
                    message=message,
                    command_timeout=self.delivery.command_timeout,
                    data_timeout=self.delivery.data_timeout,
                    started=started,
                    on_data_sent=self.on_data_sent,
                )
                reusable = tx.reusable
            finally:
                # Always given back: a connection kept by a failed task would hold its host's
                # slot for good, and the destination would wait on the pool for ever.
                await self.connections.release(
                    connected.connection, reusable=reusable, max_messages=max_messages
                )
            if not tx.stale_connection:
                break
        return tx

    def _expiries(self, delivery: Delivery) -> dict[uuid.UUID, datetime]:
        """When each recipient reaches its lane's max age."""
        age = timedelta(seconds=self.max_age_of(delivery.lane))
        return {r.id: r.queued_at + age for r in delivery.recipients}

    def _judge(
        self,
        delivery: Delivery,
        results: Sequence[RecipientResult],
        started_at: datetime,
        peer: Peer = NO_PEER,
        duration: float = 0.0,
        *,
        dkim: str | None = None,
    ) -> list[AttemptResult]:
        """`judge` with this courier's clock, retry settings and randomness; counts delivered
        mail's time from acceptance."""
        now = datetime.now(UTC)
        judged = judge(
            delivery,
            results,
            peer=peer,
            duration=duration,
            started_at=started_at,
            now=now,
            settings=self.delivery,
            rng=self.rng,
            dkim=dkim,
            max_age=self.max_age_of(delivery.lane),
        )
        for result in judged:
            if result.outcome == Outcome.DELIVERED:
                ACCEPT_TO_DELIVERY_SECONDS.observe((now - delivery.received_at).total_seconds())
        return judged


def transaction_outcome(tx: TransactionResult, throttled: Reply | None) -> TransactionOutcome:
    """What a transaction says about its destination's capacity: a throttling reply, or a
    connection that failed or broke without a reply, or neither."""
    if throttled is not None:
        return "throttled"
    if any(is_connection_failure(r.result) for r in tx.results):
        return "connection-error"
    return "healthy"
