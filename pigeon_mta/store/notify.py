"""The wake-up channel: LISTEN on a dedicated connection that is rebuilt when it drops, and NOTIFY.

An idle engine waits on `QueueWaker.wait`, which returns at the first of: a notification, a local
`wake()`, the poll interval, or `close()`. Polling covers whatever a dropped connection missed.

New mail announces itself either with a NOTIFY inside its enqueue transaction (low-rate paths), or
-- on the submission path -- through `NotifySender.poke()` after its commit: that wakes the engine
in the same process at once and sends one NOTIFY for any number of pokes that arrive while the
previous one is in flight. Either way the notification is seen only after the rows are committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import asyncpg

from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.queue import NOTIFY_CHANNEL

log = logging.getLogger(__name__)

Connector = Callable[[], Awaitable[asyncpg.Connection]]


class QueueWaker:
    def __init__(self, connect: Connector, *, retry_delay: float = 1.0) -> None:
        self._connect = connect
        self._retry_delay = retry_delay
        self._event = asyncio.Event()
        self._closed = asyncio.Event()
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self.reconnects = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="queue-listen")

    async def wait(self, timeout: float) -> bool:
        """Wait for new mail; True when a notification (or close) ended the wait."""
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)
        woke = self._event.is_set()
        self._event.clear()
        return woke

    def wake(self) -> None:
        self._event.set()

    async def close(self) -> None:
        self._closed.set()
        self._event.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None and not self._conn.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._conn.close(), 2)

    @property
    def connection(self) -> asyncpg.Connection | None:
        return self._conn

    def _on_notify(self, *_args: object) -> None:
        self._event.set()

    async def _run(self) -> None:
        first = True
        while not self._closed.is_set():
            lost = asyncio.Event()
            conn = None
            try:
                conn = await self._connect()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
            except DB_ERRORS as exc:
                log.warning("queue LISTEN connection failed: %s; retrying", exc)
                if conn is not None:  # connected, but LISTEN failed: do not leak the session
                    conn.terminate()
                await self._sleep(self._retry_delay)
                continue
            self._conn = conn
            if not first:
                self.reconnects += 1
                log.info("queue LISTEN connection rebuilt")
            first = False
            self.connected.set()
            # Anything committed while we were not listening is found by this wake-up.
            self._event.set()
            await self._watch(conn, lost)
            self.connected.clear()
            if not self._closed.is_set():
                log.warning("queue LISTEN connection lost; rebuilding")

    async def _watch(self, conn: asyncpg.Connection, lost: asyncio.Event) -> None:
        # The termination listener fires on a clean close; a backend killed under us may only
        # show on the next use, so probe now and then.
        while not lost.is_set() and not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lost.wait(), 2.0)
            if lost.is_set() or self._closed.is_set():
                break
            try:
                await asyncio.wait_for(conn.execute("SELECT 1"), 2.0)
            except DB_ERRORS:
                break
        with contextlib.suppress(Exception):
            conn.terminate()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), seconds)


class NotifySender:
    """Coalesced NOTIFYs sent after commit: one in flight at a time, at most one per
    `min_interval`, none lost at the trailing edge.

    This process's own engine is woken at once (`local`); the NOTIFY is for the other processes
    and nodes, which matter when this engine is full or delivery is off here. So with
    `local_takes` (the engine's answer to "can you take this many more recipients now?") a poke
    the local engine takes sends nothing: at moderate load each NOTIFY woke the other processes
    to claim what this engine, woken at once, had mostly taken already (bench/README.md "End to
    end"). Without a floor, a NOTIFY takes well under a millisecond, so under load nearly every
    commit sent one: a statement per message, and every listener woken as often. One per 20 ms
    costs the others at most that much delay (bench/e2e.py with RSA DKIM: 971 -> 1,040 msgs/s)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        local: QueueWaker | None = None,
        *,
        min_interval: float = 0.02,
        local_takes: Callable[[int], bool] | None = None,
    ) -> None:
        self._pool = pool
        self._local = local
        self._local_takes = local_takes
        self._min_interval = min_interval
        self._pending = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.left_local = 0  # pokes the local engine took without a NOTIFY

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="queue-notify")

    def poke(self, recipients: int = 1) -> None:
        """Called after a commit that queued a message for `recipients` recipients."""
        if self._local is not None:
            self._local.wake()
            if self._local_takes is not None and self._local_takes(recipients):
                self.left_local += 1
                return
        self._pending.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self._pending.wait()
            self._pending.clear()
            try:
                await self._pool.execute("SELECT pg_notify($1, '')", NOTIFY_CHANNEL)
                self.sent += 1
            except DB_ERRORS as exc:
                # Other engines will find the mail at their next poll.
                log.debug("NOTIFY failed: %s", exc)
                await asyncio.sleep(0.5)
            else:
                await asyncio.sleep(self._min_interval)
