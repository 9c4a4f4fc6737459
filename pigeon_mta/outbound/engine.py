"""The delivery engine: wait -> claim -> group -> sign -> route -> deliver -> record.

It waits for whichever comes first: a NOTIFY (new mail), the poll interval, or stop. Then it claims
due recipients (as many as it has room for, and of one org no more than `delivery.max_org_share` of
its slots, so that another org's mail always finds room), groups them into one transaction per
(message, destination), and runs each as a task (outbound/courier.py): sign, route, pass the
destination's limits, deliver over a pooled connection, judge each recipient's result. New mail of
this process's listeners that it has room for skips the claim: the group commit queues it already
claimed by this engine and hands it over (`reserve` / `adopt`, store/group_commit.py). Results are
recorded in batches, each batch in one database transaction (outbound/recorder.py). The claims it
holds and their leases are kept in outbound/claims.py; long transactions keep theirs by renewal.

On stop it claims nothing more, lets in-flight transactions finish until shortly before the
deadline, breaks the rest, records what finished, and releases the claim of everything else at once
so that another worker (or this node's next start) delivers it without waiting for a lease to run
out. A transaction cut off after its final dot is recorded as deferred, marked as a possible
duplicate, rather than released as if it had never been tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.model import ClaimedRow, Delivery, Signed
from pigeon_mta.outbound.budgets import Budgets
from pigeon_mta.outbound.claims import Claims, group_deliveries
from pigeon_mta.outbound.courier import Courier, Postponed, Signer
from pigeon_mta.outbound.mx import Router
from pigeon_mta.outbound.org_share import OrgShare
from pigeon_mta.outbound.outcome import interrupted_after_data, split_suppressed
from pigeon_mta.outbound.recorder import EventHandoff, Recorder
from pigeon_mta.store import leases as store_leases
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.notify import Connector, QueueWaker

log = logging.getLogger(__name__)

# Time kept back from the stop deadline to record results and release leases.
STOP_RESERVE = 2.0
# The shortest wait between two claims for the site queues.
SITE_ROUND = 0.02


async def unsigned(delivery: Delivery) -> Signed:
    """The default sign step: the body as queued (the DKIM signer replaces it)."""
    return Signed(delivery.body)


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
        record_pool: asyncpg.Pool | None = None,
        webhooks: EventHandoff | None = None,
    ) -> None:
        """`record_pool`: the connections results are recorded on (the worker gives the engine
        its own, see `store.connect.record_pool`); `pool` when not given. `webhooks`: the
        process's webhook sender, handed the events of the outcomes recorded (recorder.py)."""
        self.settings = settings
        self.delivery = settings.delivery
        # What its claims name as their holder: `serve` passes the node's run (pigeon_mta/node.py).
        self.owner = lease_owner or settings.server.node_name
        self.pool = pool
        self.router = router or Router(settings)
        self.claims = Claims(pool, owner=self.owner, lease=self.delivery.lease)
        self.courier = Courier(
            settings,
            sign=sign,
            router=self.router,
            rng=rng or random.Random(),
            on_data_sent=self.claims.mark_sent,
            budgets=lambda connections: Budgets(settings, pool, connections, self.owner),
        )
        self.connections = self.courier.connections
        self.recorder = Recorder(
            record_pool or pool,
            settings,
            self.claims,
            delivery_log or DeliveryLog.open(""),
            webhooks,
        )
        # A waker shared with this process's listeners wakes the engine at once after they queue
        # mail; it also LISTENs for mail queued elsewhere.
        self.waker = waker or (QueueWaker(listen) if listen is not None else None)
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        self._active: set[asyncio.Task[None]] = set()
        # Tasks still routing or waiting for their destination's limits: nothing sent yet.
        self._not_started: set[asyncio.Task[None]] = set()
        self._claimer: asyncio.Task[None] | None = None
        self._recorder: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        # Recipients promised to this process's listeners since the last claim (see `takes`).
        self._promised = 0
        # Recipients of messages being committed that this engine will adopt (see `reserve`).
        self._reserved = 0
        self._bite = max(1, min(self.delivery.batch_size, self.delivery.concurrency // 4))
        # Deliveries in this engine per org, and the most one org may hold: the rest of the
        # engine's slots stay free for other orgs' mail (delivery.max_org_share).
        self._org_of: dict[asyncio.Task[None], uuid.UUID] = {}
        self._orgs = OrgShare(self.delivery.concurrency, self.delivery.max_org_share, self._bite)
        self._lane_weights = {name: lane.weight for name, lane in settings.lanes.items()}

    # ------------------------------------------------------------ service

    async def start(self) -> None:
        if self.waker is not None:
            self.waker.start()
        self._recorder = asyncio.create_task(self.recorder.run(), name="delivery-record")
        self._renewer = asyncio.create_task(self.claims.renew_loop(), name="delivery-renew")
        self._claimer = asyncio.create_task(self._claim_loop(), name="delivery-claim")
        log.info(
            "delivery engine started (node %s, up to %d transactions at once)",
            self.owner,
            self.delivery.concurrency,
        )

    def _claimable(self) -> int:
        """How many the claim loop takes now: its free room, or 0 while it waits for a bite's
        worth of room (claiming for every single freed slot would cost a query per message), or
        while a claim's worth of deliveries waits for destinations' limits (claiming more, when
        those destinations are full, would hand most of each claim straight back)."""
        if len(self._not_started) >= self.delivery.batch_size:
            return 0
        room = self.delivery.concurrency - len(self._active) - self._reserved
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

    def reserve(self, recipients: int, org_id: uuid.UUID) -> tuple[str, float] | None:
        """Room for a message of this process's listeners that is being committed: the lease
        owner and lease its recipients are queued with, claimed by this engine, or None when it
        has no room now, or none for `org_id` (its share, `delivery.max_org_share`): the message
        is then queued for a claim. Held until `adopt` or `unreserve`. Mail handed over this way
        costs no claim: no statement, no body read back."""
        if self._stopping.is_set() or self._claimer is None or self._claimer.done():
            return None
        if self._claimable() - self._promised < recipients:
            return None
        if not self._orgs.fits(org_id, recipients):
            return None
        self._reserved += recipients
        self._orgs.reserve(org_id, recipients)
        return self.owner, self.delivery.lease

    def unreserve(self, recipients: int, org_id: uuid.UUID) -> None:
        self._reserved = max(0, self._reserved - recipients)
        self._orgs.unreserve(org_id, recipients)
        self._room.set()

    def adopt(self, rows: Sequence[ClaimedRow]) -> None:
        """The committed recipients of a reservation, queued claimed by this engine: delivered
        as if claimed (suppressed ones recorded, not attempted)."""
        if rows:
            self.unreserve(len(rows), rows[0].org_id)
        deliveries = group_deliveries(rows, self._destination)
        self.claims.hold(deliveries, asyncio.get_running_loop().time())
        if self._stopping.is_set():
            # Past the listeners' drain: back to the queue for another process or the next run.
            recipients = [r for d in deliveries for r in d.recipients]
            task = asyncio.create_task(self.claims.postpone(recipients, datetime.now(UTC), None))
            self._active.add(task)
            task.add_done_callback(self._done)
            return
        self._start(deliveries)

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
        self.recorder.finish()
        if self._recorder is not None:
            await self._finish(self._recorder, deadline - loop.time())
        try:
            # Handing back must not hang on an unreachable database past the deadline.
            await asyncio.wait_for(self._hand_back(), max(2.0, deadline - loop.time()))
        except TimeoutError:
            log.error(
                "delivery engine: could not hand back %d claimed recipient(s) in time; they "
                "return to the queue when their lease runs out",
                len(self.claims),
            )
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await self.connections.close()
        if self.courier.budgets is not None:
            await self.courier.budgets.close()
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
        """At stop: what finished is recorded, and everything still claimed goes back to the
        queue now. A transaction broken off after its final dot is recorded as deferred, a
        possible duplicate, rather than released as if it had never been tried."""
        if not self.claims:
            return
        now = datetime.now(UTC)
        interrupted = [interrupted_after_data(d, r, now) for d, r in self.claims.sent_unjudged()]
        try:
            await self.recorder.record_rest(interrupted)
            released = await self.claims.release_all()
        except DB_ERRORS as exc:
            log.error(
                "delivery engine: could not hand back %d claimed recipient(s) (%s); they return "
                "to the queue when their lease runs out",
                len(self.claims),
                exc,
            )
            return
        if released:
            log.info("delivery engine: %d unfinished recipient(s) are queued again", released)

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
            org_room = self._orgs.rooms()
            # Cleared before the claim: a capped org's slots freed while it runs wake the next.
            self._orgs.room.clear()
            try:
                claimed = await store_leases.claim_due_recipients(
                    self.pool,
                    owner=self.owner,
                    lease=delivery.lease,
                    batch=want,
                    lane_weights=self._lane_weights,
                    org_cap=self._orgs.cap,
                    org_room=org_room,
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
            deliveries = group_deliveries(claimed.rows, self._destination)
            self.claims.hold(deliveries, loop.time())
            self._start(deliveries)
            if claimed.rows and len(claimed.rows) < want and self._orgs.limited(org_room, want):
                # Short because an org's room ran out, not (perhaps) because nothing more is
                # due: claim again at once. Each such claim takes at least one row; the first
                # that takes none waits below.
                continue
            if len(claimed.rows) < want:
                # A site queue whose budget had no more room has some again this soon; an org
                # at its cap, when a few of its deliveries are done.
                wait = float(delivery.poll_interval)
                if claimed.come_back is not None:
                    wait = min(wait, max(SITE_ROUND, claimed.come_back))
                await self._idle(wait, self._orgs.room if self._orgs.capped() else None)
                # Woken (by new mail, most likely): let what is being queued right now join
                # this claim instead of costing one each.
                await self._pause(delivery.claim_wait)

    async def _pause(self, seconds: float) -> None:
        if seconds > 0 and not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _idle(self, timeout: float, room: asyncio.Event | None = None) -> None:
        """Wait for new mail (the waker), `room`, stop, or `timeout` seconds."""
        if self._stopping.is_set():
            return
        if room is None:
            if self.waker is not None:
                await self.waker.wait(timeout)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout)
            return
        waits: list[asyncio.Future[object]] = [
            asyncio.ensure_future(self._stopping.wait()),
            asyncio.ensure_future(room.wait()),
        ]
        if self.waker is not None:
            waits.append(asyncio.ensure_future(self.waker.wait(timeout)))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def _destination(self, domain: str) -> str:
        """Where a domain's mail goes: recipients of one message at domains that share a static
        route or the relayhost travel in one transaction."""
        route = self.router.static_route(domain)
        return route.destination if route else f"mx:{domain}"

    def _start(self, deliveries: Sequence[Delivery]) -> None:
        """Deliver claimed work. Recipients on their org's suppression list (read by the claim,
        or by the enqueue of handed-off mail) are recorded `suppressed`, not attempted. A list
        that cannot be read fails that statement: nobody is mailed whom the list might hold."""
        deliveries, suppressed = split_suppressed(deliveries, now=datetime.now(UTC))
        self.recorder.submit(suppressed)
        for d in deliveries:
            self._spawn(d)

    def _spawn(self, delivery: Delivery) -> None:
        task = asyncio.create_task(self._process(delivery), name="delivery")
        self._active.add(task)
        self._not_started.add(task)
        self._orgs.started(delivery.org_id)
        self._org_of[task] = delivery.org_id
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._active.discard(task)
        org = self._org_of.pop(task, None)
        if org is not None:
            self._orgs.done(org)
        self._room.set()

    # ------------------------------------------------------------ one delivery

    async def _process(self, delivery: Delivery) -> None:
        task = asyncio.current_task()

        def sending() -> None:
            if task is not None and task in self._not_started:
                self._not_started.discard(task)
                if len(self._not_started) == self.delivery.batch_size - 1:
                    self._room.set()

        try:
            done = await self.courier.deliver(delivery, sending=sending)
            if isinstance(done, Postponed):
                # The destination has no room now: back to the queue until it should have.
                await self.claims.postpone(
                    delivery.recipients,
                    done.until,
                    done.reason,
                    done.site,
                    (delivery.org_id, delivery.lane, delivery.domain),
                )
                return
        finally:
            sending()
        self.recorder.submit(done)

    # ------------------------------------------------------------ introspection

    @property
    def in_flight(self) -> int:
        return len(self._active)
