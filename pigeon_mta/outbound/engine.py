"""The delivery engine: wait -> claim -> group -> sign -> route -> deliver -> record.

It waits for whichever comes first: a NOTIFY (new mail), the poll interval, or stop. Then it claims
due recipients (as many as it has room for), groups them into one transaction per (message,
destination), and runs each as a task: sign, route, pass the destination's limits, deliver over a
pooled connection, classify each recipient's result. Results are recorded in batches, each batch in
one database transaction (`record`). Long transactions keep their claim by renewing its lease.

On stop it claims nothing more, lets in-flight transactions finish until shortly before the
deadline, breaks the rest, records what finished, and releases the claim of everything else at once
so that another worker (or this node's next start) delivers it without waiting for a lease to run
out. A transaction cut off after its final dot is recorded as deferred, marked as a possible
duplicate, rather than released as if it had never been tried.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg

from pigeon_mta.bounce_classify import classify_reply
from pigeon_mta.config import Settings, TlsPolicy
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.metrics import ACCEPT_TO_DELIVERY_SECONDS, DELIVERIES, DELIVERY_ATTEMPT_SECONDS
from pigeon_mta.model import AttemptResult, ClaimedRecipient, Delivery, Outcome, Reply, Signed
from pigeon_mta.outbound.attempt import (
    Peer,
    RecipientResult,
    TransactionResult,
    not_connected,
    transact,
    wire_message,
)
from pigeon_mta.outbound.classify import backoff_delay, classify, give_up_repeated_failure
from pigeon_mta.outbound.connect import ConnectOptions
from pigeon_mta.outbound.limits import Gate, Gates, policy_for
from pigeon_mta.outbound.mx import Route, RouteFailure, Router
from pigeon_mta.outbound.pool import ConnectionPool, NotConnected
from pigeon_mta.signer import KeysUnavailable
from pigeon_mta.store import bounces as store_bounces
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store import suppression as store_suppression
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.notify import Connector, QueueWaker

log = logging.getLogger(__name__)

Signer = Callable[[Delivery], Awaitable[Signed]]


# Results recorded in one statement at most; a busy engine records in batches of up to this.
RECORD_BATCH = 1000
# Time kept back from the stop deadline to record results and release leases.
STOP_RESERVE = 2.0


async def unsigned(delivery: Delivery) -> Signed:
    """The default sign step: the body as queued (the DKIM signer replaces it)."""
    return Signed(delivery.body)


@dataclass
class _Held:
    """A claimed recipient not yet recorded."""

    delivery: Delivery
    recipient: ClaimedRecipient
    renewed_at: float


class DeliveryEngine:
    """The outbound side of one worker process (a `Service`: start / stop(deadline))."""

    name = "delivery"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        listen: Connector | None = None,
        sign: Signer = unsigned,
        router: Router | None = None,
        rng: random.Random | None = None,
        delivery_log: DeliveryLog | None = None,
        waker: QueueWaker | None = None,
        lease_owner: str = "",
    ) -> None:
        self.settings = settings
        self.delivery = settings.delivery
        # What its claims name as their holder: `serve` passes the node's run (pigeon_mta/node.py).
        self.owner = lease_owner or settings.server.node_name
        self.pool = pool
        self.sign = sign
        self.router = router or Router(settings)
        self.connections = ConnectionPool(
            ConnectOptions.from_settings(settings.server.hostname, settings.delivery),
            max_per_host=settings.delivery.max_connections_per_host,
            idle_timeout=settings.delivery.idle_timeout,
        )
        self.gates = Gates()
        self.delivery_log = delivery_log or DeliveryLog.open("")
        # A waker shared with this process's listeners wakes the engine at once after they queue
        # mail; it also LISTENs for mail queued elsewhere.
        self.waker = waker or (QueueWaker(listen) if listen is not None else None)
        self._rng = rng or random.Random()
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        self._active: set[asyncio.Task[None]] = set()
        # Tasks still routing or waiting for their destination's limits: nothing sent yet.
        self._not_started: set[asyncio.Task[None]] = set()
        self._held: dict[uuid.UUID, _Held] = {}
        self._data_sent: set[uuid.UUID] = set()
        self._pending: list[AttemptResult] = []
        self._pending_event = asyncio.Event()
        self._recorder_done = False
        self._claimer: asyncio.Task[None] | None = None
        self._recorder: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        # Recipients promised to this process's listeners since the last claim (see `takes`).
        self._promised = 0
        self._bite = max(1, min(self.delivery.batch_size, self.delivery.concurrency // 4))

    # ------------------------------------------------------------ service

    async def start(self) -> None:
        if self.waker is not None:
            self.waker.start()
        self._recorder = asyncio.create_task(self._record_loop(), name="delivery-record")
        self._renewer = asyncio.create_task(self._renew_loop(), name="delivery-renew")
        self._claimer = asyncio.create_task(self._claim_loop(), name="delivery-claim")
        log.info(
            "delivery engine started (node %s, up to %d transactions at once)",
            self.owner,
            self.delivery.concurrency,
        )

    def _claimable(self) -> int:
        """How many the claim loop takes now: its free room, or 0 while it waits for a bite's
        worth of room (claiming for every single freed slot would cost a query per message)."""
        room = self.delivery.concurrency - len(self._active)
        return 0 if room < self._bite and self._active else room

    def takes(self, recipients: int) -> bool:
        """Whether this engine, woken by the caller, will claim `recipients` more at once: what
        it claims now, less what it was promised since its last claim. The listeners'
        NotifySender asks before it wakes the other processes and nodes with a NOTIFY; a wrong
        yes costs them at most a poll interval, never a message."""
        if self._stopping.is_set() or self._claimer is None or self._claimer.done():
            return False
        if self._claimable() - self._promised < recipients:
            return False
        self._promised += recipients
        return True

    async def stop(self, deadline: float) -> None:
        if self._stopping.is_set():
            return
        loop = asyncio.get_running_loop()
        self._stopping.set()
        self._room.set()
        if self.waker is not None:
            self.waker.wake()
        if self._claimer is not None:
            await self._finish(self._claimer, deadline - loop.time())
        # Work that has not reached its SMTP transaction is handed back at once.
        for task in self._not_started:
            task.cancel()
        # In-flight transactions may finish until shortly before the deadline.
        reserve = min(STOP_RESERVE, max(0.0, deadline - loop.time()) / 4)
        active = set(self._active)
        if active:
            log.info("delivery engine stopping: %d transaction(s) in flight", len(active))
            _, unfinished = await asyncio.wait(
                active, timeout=max(0.0, deadline - reserve - loop.time())
            )
            if unfinished:
                log.warning(
                    "delivery engine: %d transaction(s) did not finish by the deadline; "
                    "breaking them off",
                    len(unfinished),
                )
                for task in unfinished:
                    task.cancel()
                self.connections.abort_busy()
                await asyncio.gather(*unfinished, return_exceptions=True)
        # Record what finished, then hand back what did not.
        self._recorder_done = True
        self._pending_event.set()
        if self._recorder is not None:
            await self._finish(self._recorder, deadline - loop.time())
        try:
            # Handing back must not hang on an unreachable database past the deadline.
            await asyncio.wait_for(self._hand_back(), max(2.0, deadline - loop.time()))
        except TimeoutError:
            log.error(
                "delivery engine: could not hand back %d claimed recipient(s) in time; they "
                "return to the queue when their lease runs out",
                len(self._held),
            )
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await self.connections.close()
        if self.waker is not None:
            await self.waker.close()
        log.info("delivery engine stopped")

    @staticmethod
    async def _finish(task: asyncio.Task[None], timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(task), max(0.1, timeout))
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _hand_back(self) -> None:
        """At stop: everything still claimed goes back to the queue now."""
        if not self._held:
            return
        now = datetime.now(UTC)
        unrecorded = {r.recipient_id for r in self._pending}
        interrupted = [
            self._interrupted_after_data(held, now)
            for rid, held in self._held.items()
            if rid in self._data_sent and rid not in unrecorded
        ]
        final = [*self._pending, *interrupted]
        try:
            if final:
                await self.record(final)
                for result in final:
                    self._forget(result)
            ids, attempts = self._claims(list(self._held))
            released = await store_queue.release_leases(
                self.pool, ids, owner=self.owner, attempts=attempts
            )
        except DB_ERRORS as exc:
            log.error(
                "delivery engine: could not hand back %d claimed recipient(s) (%s); they return "
                "to the queue when their lease runs out",
                len(self._held),
                exc,
            )
            return
        if released:
            log.info("delivery engine: %d unfinished recipient(s) are queued again", released)
        self._pending.clear()
        self._held.clear()

    def _interrupted_after_data(self, held: _Held, now: datetime) -> AttemptResult:
        return AttemptResult(
            recipient_id=held.recipient.id,
            message_id=held.delivery.message_id,
            org_id=held.delivery.org_id,
            attempt=held.recipient.attempts,
            outcome=Outcome.DEFERRED,
            reply=Reply(
                0,
                "4.3.2",
                "shutdown broke off the transaction after the message was sent; it may have "
                "been delivered (possible duplicate on retry)",
            ),
            started_at=now,
            next_attempt_at=now,
            rule="interrupted-after-data",
        )

    # ------------------------------------------------------------ wait + claim

    async def _claim_loop(self) -> None:
        delivery = self.delivery
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            room = self._claimable()
            if not room:
                self._room.clear()
                await self._room.wait()
                continue
            want = min(delivery.batch_size, room)
            try:
                claimed = await store_queue.claim_due_recipients(
                    self.pool, owner=self.owner, lease=delivery.lease, batch=want
                )
            except DB_ERRORS as exc:
                log.warning("delivery engine cannot claim work: %s", exc)
                await self._idle(delivery.poll_interval)
                continue
            except Exception:
                # A bug must not silently end claiming for the life of the process.
                log.exception("delivery engine: claiming failed unexpectedly")
                await self._idle(delivery.poll_interval)
                continue
            self._promised = 0
            now = loop.time()
            count = 0
            for d in claimed:
                for r in d.recipients:
                    self._held[r.id] = _Held(d, r, now)
                    count += 1
            claimed = self._drop_suppressed(claimed)
            for d in self._group(claimed):
                self._spawn(d)
            if count < want:
                await self._idle(delivery.poll_interval)
                # Woken (by new mail, most likely): let what is being queued right now join
                # this claim instead of costing one each.
                await self._pause(delivery.claim_wait)

    def _drop_suppressed(self, claimed: list[Delivery]) -> list[Delivery]:
        """Recipients on their org's suppression list (read by the claim) are recorded
        `suppressed`, not attempted. A list that cannot be read fails the claim itself: nobody
        is mailed whom the list might hold."""
        keep, suppressed = store_suppression.split_suppressed(claimed)
        if suppressed:
            self._submit(suppressed)
        return keep

    async def _pause(self, seconds: float) -> None:
        if seconds > 0 and not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _idle(self, timeout: float) -> None:
        if self._stopping.is_set():
            return
        if self.waker is not None:
            await self.waker.wait(timeout)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout)

    def _group(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """One transaction per (message, destination): recipients of one message at domains that
        share a static route or the relayhost travel together."""
        groups: dict[tuple[uuid.UUID, str], Delivery] = {}
        for d in deliveries:
            route = self.router.static_route(d.domain)
            key = (d.message_id, route.destination if route else f"mx:{d.domain}")
            if key in groups:
                first = groups[key]
                groups[key] = dataclasses.replace(first, recipients=first.recipients + d.recipients)
            else:
                groups[key] = d
        return list(groups.values())

    def _spawn(self, delivery: Delivery) -> None:
        task = asyncio.create_task(self._process(delivery), name="delivery")
        self._active.add(task)
        self._not_started.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._active.discard(task)
        self._room.set()

    # ------------------------------------------------------------ one delivery

    async def _process(self, delivery: Delivery) -> None:
        started_at = datetime.now(UTC)
        task = asyncio.current_task()
        try:
            results = await self._deliver(delivery, started_at)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, KeysUnavailable):
                # The database is away (a restart, a failover): a temporary local failure, and
                # expected, so no traceback.
                log.warning("message %s deferred: %s", delivery.message_id, exc)
            else:
                # A bug must not lose mail: the recipients are deferred and the error logged.
                log.exception("delivery of message %s failed unexpectedly", delivery.message_id)
            results = self._judge(
                delivery,
                [RecipientResult(r, "connect", exc) for r in delivery.recipients],
                Peer(None, None, None),
                0.0,
                started_at,
            )
        finally:
            if task is not None:
                self._not_started.discard(task)
        self._submit(results)

    async def _deliver(self, delivery: Delivery, started_at: datetime) -> list[AttemptResult]:
        route = await self.router.route(delivery.domain)
        if isinstance(route, RouteFailure):
            return self._judge(
                delivery,
                [RecipientResult(r, "route", route.reply) for r in delivery.recipients],
                Peer(None, None, None),
                0.0,
                started_at,
            )
        policy = policy_for(self.delivery, delivery.domain, route)
        entered = await self.gates.enter(policy, self.delivery.throttle_wait)
        if not isinstance(entered, Gate):
            await self._postpone(delivery, entered)
            return []
        task = asyncio.current_task()
        if task is not None:
            self._not_started.discard(task)
        try:
            signed = await self.sign(delivery)
            tx = await self._transaction(
                delivery, signed.body, route, policy.tls, policy.max_messages_per_connection
            )
        finally:
            self.gates.leave(entered)
        DELIVERY_ATTEMPT_SECONDS.observe(tx.duration)
        # Started so that start + duration is when the final reply came (attempt.py).
        tx_started_at = tx.finished_at - timedelta(seconds=tx.duration)
        return self._judge(
            delivery, list(tx.results), tx.peer, tx.duration, tx_started_at, dkim=signed.dkim
        )

    async def _transaction(
        self, delivery: Delivery, body: bytes, route: Route, tls: TlsPolicy, max_messages: int
    ) -> TransactionResult:
        message = wire_message(body)
        started = asyncio.get_running_loop().time()
        for _ in range(2):
            connected = await self.connections.connect(route, tls, self.router)
            if isinstance(connected, NotConnected):
                return not_connected(delivery.recipients, connected, started)
            reusable = False  # unless the transaction says so: an error escaping it breaks it
            try:
                tx = await transact(
                    connected,
                    sender=delivery.sender,
                    recipients=delivery.recipients,
                    message=message,
                    command_timeout=self.delivery.command_timeout,
                    data_timeout=self.delivery.data_timeout,
                    started=started,
                    on_data_sent=self._data_sent.update,
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

    async def _postpone(self, delivery: Delivery, seconds: float) -> None:
        """The destination has no room now: back to the queue until it should, unattempted."""
        until = datetime.now(UTC) + timedelta(seconds=seconds * self._rng.uniform(1.0, 1.2))
        await self._give_back(delivery.recipients, due_at=until)

    async def _give_back(
        self, recipients: Sequence[ClaimedRecipient], *, due_at: datetime | None = None
    ) -> None:
        """Release these claims unattempted, due again at once or at `due_at`, and forget them."""
        try:
            await store_queue.release_leases(
                self.pool,
                [r.id for r in recipients],
                owner=self.owner,
                attempts=[r.attempts for r in recipients],
                due_at=due_at,
            )
        except DB_ERRORS as exc:
            # No longer renewed, the claims run out and the lease sweeper queues them again.
            log.warning("could not hand back %d claimed recipient(s): %s", len(recipients), exc)
        for r in recipients:
            self._held.pop(r.id, None)

    def _judge(
        self,
        delivery: Delivery,
        results: Sequence[RecipientResult],
        peer: Peer,
        duration: float,
        started_at: datetime,
        *,
        dkim: str | None = None,
    ) -> list[AttemptResult]:
        """Each recipient's result -> an AttemptResult: outcome, next try, or expiry. `dkim` says
        how the message that was sent was signed (None when it was not sent)."""
        settings = self.delivery
        now = datetime.now(UTC)
        max_age = timedelta(seconds=settings.max_age)
        out: list[AttemptResult] = []
        for item in results:
            verdict = classify(item.result, item.stage)
            if not isinstance(item.result, KeysUnavailable):  # the database away: it passes
                verdict = give_up_repeated_failure(verdict, item.recipient.last_reply)
            outcome, rule, next_at = verdict.outcome, verdict.rule, None
            if outcome == Outcome.DEFERRED:
                delay = backoff_delay(
                    item.recipient.attempts, settings.retry_initial, settings.retry_max, self._rng
                )
                next_at = now + timedelta(seconds=delay)
                if next_at > item.recipient.queued_at + max_age:
                    # The next try would come after max_age: give up now, with this reply.
                    outcome, rule, next_at = Outcome.EXPIRED, f"{rule}; max-age", None
            elif outcome == Outcome.DELIVERED:
                ACCEPT_TO_DELIVERY_SECONDS.observe((now - delivery.received_at).total_seconds())
            category = None
            if outcome != Outcome.DELIVERED:
                bounce_class = classify_reply(verdict.reply)
                category, rule = str(bounce_class.category), f"{rule}; {bounce_class.rule}"
            out.append(
                AttemptResult(
                    recipient_id=item.recipient.id,
                    message_id=delivery.message_id,
                    org_id=delivery.org_id,
                    attempt=item.recipient.attempts,
                    outcome=outcome,
                    reply=verdict.reply.storable(),
                    started_at=started_at,
                    duration=duration,
                    next_attempt_at=next_at,
                    mx_host=peer.host,
                    ip=peer.ip,
                    port=peer.port,
                    tls_version=peer.tls_version,
                    tls_cipher=peer.tls_cipher,
                    category=category,
                    rule=rule,
                    dkim=dkim,
                )
            )
        return out

    # ------------------------------------------------------------ record

    def _submit(self, results: Sequence[AttemptResult]) -> None:
        for result in results:
            self._data_sent.discard(result.recipient_id)
        self._pending.extend(results)
        self._pending_event.set()

    async def record(self, results: Sequence[AttemptResult]) -> None:
        """Record one batch of outcomes, in ONE database transaction.

        Everything that must commit together with an outcome belongs in this transaction (bounce
        messages for bounced and expired recipients, suppression entries).
        """
        applied = (
            await store_bounces.record_attempts_and_bounce(
                self.pool,
                results,
                hostname=self.settings.server.hostname,
                suppress_for=self.settings.bounces.suppress_for,
            )
        ).applied
        # Only outcomes that took effect: a fenced-out (stale) result is logged, not counted.
        counts = collections.Counter(str(r.outcome) for r in results if r.recipient_id in applied)
        for outcome, count in counts.items():
            DELIVERIES.labels(outcome=outcome).inc(count)
        self._log_results(results)

    def _log_results(self, results: Sequence[AttemptResult]) -> None:
        """Delivery-log records, written after the commit (the same events are in the database)."""
        by_delivery: dict[int, tuple[Delivery, list[AttemptResult]]] = {}
        for result in results:
            held = self._held.get(result.recipient_id)
            if held is None:
                continue
            entry = by_delivery.setdefault(id(held.delivery), (held.delivery, []))
            entry[1].append(result)
        for delivery, delivered in by_delivery.values():
            self.delivery_log.attempts(delivery, delivered)

    async def _record_loop(self) -> None:
        while True:
            if not self._pending:
                if self._recorder_done:
                    return
                self._pending_event.clear()
                await self._pending_event.wait()
                if not self._recorder_done:
                    # Let the results of transactions finishing right now join this batch.
                    await asyncio.sleep(self.delivery.record_wait)
                continue
            batch = self._pending[:RECORD_BATCH]
            try:
                await self.record(batch)
            except DB_ERRORS as exc:
                log.warning("could not record %d delivery result(s): %s; retrying", len(batch), exc)
                if self._recorder_done:
                    return
                await asyncio.sleep(1.0)
                continue
            except Exception:
                # Keep the results (dropping them would send the mail again after the lease);
                # the error is in the log every time it happens.
                log.exception("could not record %d delivery result(s); retrying", len(batch))
                if self._recorder_done:
                    return
                await asyncio.sleep(1.0)
                continue
            del self._pending[: len(batch)]
            for result in batch:
                self._forget(result)

    # ------------------------------------------------------------ leases

    async def _renew_loop(self) -> None:
        lease = self.delivery.lease
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(1.0, lease / 4))
            now = loop.time()
            due = [rid for rid, held in self._held.items() if now - held.renewed_at >= lease / 3]
            if not due:
                continue
            ids, attempts = self._claims(due)
            try:
                await store_queue.renew_leases(
                    self.pool, ids, owner=self.owner, lease=lease, attempts=attempts
                )
            except DB_ERRORS as exc:
                log.warning("could not renew %d lease(s): %s", len(due), exc)
                continue
            except Exception:
                log.exception("could not renew %d lease(s)", len(due))
                continue
            for rid in due:
                held = self._held.get(rid)
                if held is not None:
                    held.renewed_at = now

    def _claims(self, ids: Sequence[uuid.UUID]) -> tuple[list[uuid.UUID], list[int]]:
        """The (recipient id, attempt number) of each claim this process holds among `ids`."""
        held = [(rid, self._held[rid].recipient.attempts) for rid in ids if rid in self._held]
        return [rid for rid, _ in held], [n for _, n in held]

    def _forget(self, result: AttemptResult) -> None:
        """Drop the claim a recorded result belonged to; not a newer claim of the same row."""
        held = self._held.get(result.recipient_id)
        if held is not None and held.recipient.attempts == result.attempt:
            del self._held[result.recipient_id]

    # ------------------------------------------------------------ introspection

    @property
    def in_flight(self) -> int:
        return len(self._active)
