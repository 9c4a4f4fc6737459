"""One engine's room: its deliveries in flight (each org within `delivery.max_org_share` of the
slots, org_share.py), how many recipients a claim may take now, and what it promised or reserved
to this process's listeners (store/group_commit.py hands it their mail); and the waits of its loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

from pigeon_mta.config import DeliverySettings
from pigeon_mta.outbound.org_share import OrgShare
from pigeon_mta.store.notify import QueueWaker

log = logging.getLogger("pigeon_mta.outbound.engine")


class Room:
    def __init__(self, delivery: DeliverySettings) -> None:
        self.delivery = delivery
        self.active: set[asyncio.Task[None]] = set()
        # Tasks still routing or waiting for their destination's limits: nothing sent yet.
        self.not_started: set[asyncio.Task[None]] = set()
        # Set whenever room may have come free: the claim loop waits on it.
        self.changed = asyncio.Event()
        # Recipients promised to this process's listeners since the last claim (see `takes`).
        self.promised = 0
        # Recipients of messages being committed that this engine will adopt (see `reserve`).
        self.reserved = 0
        self.bite = max(1, min(delivery.batch_size, delivery.concurrency // 4))
        # Deliveries in this engine per org, and the most one org may hold: the rest of the
        # engine's slots stay free for other orgs' mail.
        self.orgs = OrgShare(delivery.concurrency, delivery.max_org_share, self.bite)
        self._org_of: dict[asyncio.Task[None], uuid.UUID] = {}

    def claimable(self) -> int:
        """How many the claim loop takes now: its free room, or 0 while it waits for a bite's
        worth of room (claiming for every single freed slot would cost a query per message), or
        while a claim's worth of deliveries waits for destinations' limits (claiming more, when
        those destinations are full, would hand most of each claim straight back)."""
        if len(self.not_started) >= self.delivery.batch_size:
            return 0
        room = self.delivery.concurrency - len(self.active) - self.reserved
        return 0 if room < self.bite and self.active else room

    def takes(self, recipients: int) -> bool:
        """Whether the next claim takes `recipients` more at once: what it claims now, less what
        was promised since the last claim; promises them if so."""
        if self.claimable() - self.promised < recipients:
            return False
        self.promised += recipients
        return True

    def reserve(self, recipients: int, org_id: uuid.UUID) -> bool:
        """Room for a message being committed, within its org's share; held until `unreserve`."""
        if self.claimable() - self.promised < recipients:
            return False
        if not self.orgs.fits(org_id, recipients):
            return False
        self.reserved += recipients
        self.orgs.reserve(org_id, recipients)
        return True

    def unreserve(self, recipients: int, org_id: uuid.UUID) -> None:
        self.reserved = max(0, self.reserved - recipients)
        self.orgs.unreserve(org_id, recipients)
        self.changed.set()

    def add(self, task: asyncio.Task[None], org_id: uuid.UUID | None, *, sends: bool) -> None:
        """A task of this engine: a delivery of `org_id` that `sends` (until `sending`), or other
        work that holds a slot until it ends."""
        self.active.add(task)
        if sends:
            self.not_started.add(task)
        if org_id is not None:
            self.orgs.started(org_id)
            self._org_of[task] = org_id
        task.add_done_callback(self._done)

    def sending(self, task: asyncio.Task[None] | None) -> None:
        """The delivery `task` passed its destination's limits (or ended)."""
        if task is not None and task in self.not_started:
            self.not_started.discard(task)
            if len(self.not_started) == self.delivery.batch_size - 1:
                self.changed.set()

    async def finish(self, timeout: float, abort: Callable[[], None]) -> None:
        """At stop: let the tasks in flight finish within `timeout` seconds, then break off the
        rest (`abort` first breaks their connections)."""
        active = set(self.active)
        if not active:
            return
        log.info("delivery engine stopping: %d transaction(s) in flight", len(active))
        _, unfinished = await asyncio.wait(active, timeout=max(0.0, timeout))
        if unfinished:
            log.warning(
                "delivery engine: %d transaction(s) did not finish by the deadline; "
                "breaking them off",
                len(unfinished),
            )
            for task in unfinished:
                task.cancel()
            abort()
            await asyncio.gather(*unfinished, return_exceptions=True)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.active.discard(task)
        org = self._org_of.pop(task, None)
        if org is not None:
            self.orgs.done(org)
        self.changed.set()


async def wait_any(
    timeout: float,
    stopping: asyncio.Event,
    room: asyncio.Event | None = None,
    waker: QueueWaker | None = None,
) -> None:
    """Wait for new mail (the waker), `room`, stop, or `timeout` seconds."""
    if stopping.is_set():
        return
    if room is None:
        if waker is not None:
            await waker.wait(timeout)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout)
        return
    waits: list[asyncio.Future[object]] = [
        asyncio.ensure_future(stopping.wait()),
        asyncio.ensure_future(room.wait()),
    ]
    if waker is not None:
        waits.append(asyncio.ensure_future(waker.wait(timeout)))
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def finish_task(task: asyncio.Task[None], timeout: float) -> None:
    """Let `task` end within `timeout` seconds (0.1 at least), else cancel it."""
    try:
        await asyncio.wait_for(asyncio.shield(task), max(0.1, timeout))
    except TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
