"""The delivery engine: wait -> claim -> group -> route -> limits -> sign -> deliver -> record.

It waits for whichever comes first: a NOTIFY (new mail), the poll interval, or stop. Then it claims
due recipients (as many as it has room for, and of one org no more than `delivery.max_org_share` of
its slots, so that another org's mail always finds room), groups them into one transaction per
(message, destination), and runs each as a task (outbound/courier.py): route, pass the
destination's limits, sign, deliver over a pooled connection, judge each recipient's result. New mail of
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
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.model import ClaimedRow, Delivery
from pigeon_mta.outbound.budgets import Budgets
from pigeon_mta.outbound.claims import Claims, group_deliveries
from pigeon_mta.outbound.courier import Courier, Postponed, Signer, unsigned
from pigeon_mta.outbound.mx import Router
from pigeon_mta.outbound.outcome import split_past_deadline, split_suppressed
from pigeon_mta.outbound.recorder import EventHandoff, Recorder
from pigeon_mta.outbound.room import Room, finish_task, wait_any
from pigeon_mta.store import claims as store_claims
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.notify import Connector, QueueWaker

log = logging.getLogger(__name__)

# Time kept back from the stop deadline to record results and release leases.
STOP_RESERVE = 2.0
# The shortest wait between two claims for the site queues.
SITE_ROUND = 0.02


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
        senders: Callable[[Sequence[Delivery]], list[Delivery]] = list,
    ) -> None:
        """`record_pool`: what results are recorded on (store/connect.py), else `pool`;
        `webhooks`: the process's webhook sender, handed the events of the recorded outcomes
        (recorder.py); `senders`: the deliveries as they leave (feedback/return_paths.py)."""
        self.settings = settings
        self.delivery = settings.delivery
        # What its claims name as their holder: `serve` passes the node's run (pigeon_mta/node.py).
        self.owner = lease_owner or settings.server.node_name
        self.pool = pool
        self.router = router or Router(settings)
        self.claims = Claims(pool, owner=self.owner, lease=self.delivery.lease)
        self._senders = senders
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
        # Shared with this process's listeners: woken at once after they queue; LISTENs too.
        self.waker = waker or (QueueWaker(listen) if listen is not None else None)
        self._stopping = asyncio.Event()
        self.room = Room(self.delivery)
        self._claimer: asyncio.Task[None] | None = None
        self._recorder: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
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

    def takes(self, recipients: int) -> bool:
        """Whether this engine, woken by the caller, will claim `recipients` more at once: what
        it claims now, less what it was promised since its last claim. The listeners'
        NotifySender asks before it wakes the other processes and nodes with a NOTIFY; a wrong
        yes costs them at most a poll interval, never a message."""
        return self._claiming() and self.room.takes(recipients)

    def reserve(self, recipients: int, org_id: uuid.UUID) -> tuple[str, float] | None:
        """Room for a message of this process's listeners being committed (group_commit.Engine):
        mail handed over this way costs no claim, no statement, no body read back."""
        if not (self._claiming() and self.room.reserve(recipients, org_id)):
            return None
        return self.owner, self.delivery.lease

    def unreserve(self, recipients: int, org_id: uuid.UUID) -> None:
        self.room.unreserve(recipients, org_id)

    def _claiming(self) -> bool:
        return not (self._stopping.is_set() or self._claimer is None or self._claimer.done())

    def adopt(self, rows: Sequence[ClaimedRow]) -> None:
        """The committed recipients of a reservation, queued claimed by this engine: delivered
        as if claimed (suppressed ones recorded, not attempted)."""
        if rows:
            self.unreserve(len(rows), rows[0].org_id)
        deliveries = self._senders(group_deliveries(rows, self.router.destination))
        self.claims.hold(deliveries, asyncio.get_running_loop().time())
        if self._stopping.is_set():
            # Past the listeners' drain: back to the queue for another process or the next run.
            recipients = [r for d in deliveries for r in d.recipients]
            task = asyncio.create_task(self.claims.postpone(recipients, datetime.now(UTC), None))
            self.room.add(task, None, sends=False)
            return
        self._start(deliveries)

    async def stop(self, deadline: float) -> None:
        if self._stopping.is_set():
            return
        loop = asyncio.get_running_loop()
        self._stopping.set()
        self.room.changed.set()
        if self.waker is not None:
            self.waker.wake()
        if self._claimer is not None:
            await finish_task(self._claimer, deadline - loop.time())
        # Work not at its SMTP transaction is handed back; in-flight ones may finish.
        for task in self.room.not_started:
            task.cancel()
        reserve = min(STOP_RESERVE, max(0.0, deadline - loop.time()) / 4)
        await self.room.finish(deadline - reserve - loop.time(), self.connections.abort_busy)
        # Record what finished, then hand back what did not.
        self.recorder.finish()
        if self._recorder is not None:
            await finish_task(self._recorder, deadline - loop.time())
        try:
            # Handing back must not hang on an unreachable database past the deadline.
            await asyncio.wait_for(self.recorder.hand_back(), max(2.0, deadline - loop.time()))
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
        await self.courier.budgets.close()
        if self.waker is not None:
            await self.waker.close()
        log.info("delivery engine stopped")

    # ------------------------------------------------------------ wait + claim

    async def _claim_loop(self) -> None:
        delivery = self.delivery
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            room = self.room.claimable()
            if not room:
                self.room.changed.clear()
                await self.room.changed.wait()
                continue
            want = min(delivery.batch_size, room)
            orgs = self.room.orgs
            org_room = orgs.rooms()
            # Cleared before the claim: a capped org's slots freed while it runs wake the next.
            orgs.room.clear()
            try:
                claimed = await store_claims.claim_due_recipients(
                    self.pool,
                    owner=self.owner,
                    lease=delivery.lease,
                    batch=want,
                    lane_weights=self._lane_weights,
                    org_cap=orgs.cap,
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
            self.room.promised = 0
            deliveries = self._senders(group_deliveries(claimed.rows, self.router.destination))
            self.claims.hold(deliveries, loop.time())
            self._start(deliveries)
            if claimed.rows and len(claimed.rows) < want and orgs.limited(org_room, want):
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
                await self._idle(wait, orgs.room if orgs.capped() else None)
                # Woken (by new mail, most likely): let what is being queued right now join
                # this claim instead of costing one each.
                await self._pause(delivery.claim_wait)

    async def _pause(self, seconds: float) -> None:
        if seconds > 0 and not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _idle(self, timeout: float, room: asyncio.Event | None = None) -> None:
        """Wait for new mail (the waker), `room`, stop, or `timeout` seconds."""
        await wait_any(timeout, self._stopping, room, self.waker)

    def _start(self, deliveries: Sequence[Delivery]) -> None:
        """Deliver claimed work. Recipients on their org's suppression list (read by the claim,
        or by the enqueue of handed-off mail) are recorded `suppressed`, not attempted; those of a
        message past its deadline `expired`. A list
        that cannot be read fails that statement: nobody is mailed whom the list might hold."""
        now = datetime.now(UTC)
        deliveries, suppressed = split_suppressed(deliveries, now=now)
        deliveries, expired = split_past_deadline(deliveries, now=now)
        self.recorder.submit([*suppressed, *expired])
        for d in deliveries:
            self._spawn(d)

    def _spawn(self, delivery: Delivery) -> None:
        task = asyncio.create_task(self._process(delivery), name="delivery")
        self.room.add(task, delivery.org_id, sends=True)

    # ------------------------------------------------------------ one delivery

    async def _process(self, delivery: Delivery) -> None:
        task = asyncio.current_task()

        def sending() -> None:
            self.room.sending(task)

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

    @property
    def in_flight(self) -> int:
        return len(self.room.active)
