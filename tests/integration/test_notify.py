"""The wake-up channel: NOTIFY wakes an idle worker; a killed LISTEN connection is rebuilt."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg

from pigeon_mta.model import Envelope
from pigeon_mta.store import queue
from pigeon_mta.store.notify import QueueWaker

POLL = 30.0  # far longer than any wake-up we accept


def mail(org_id: uuid.UUID) -> Envelope:
    return Envelope(
        org_id=org_id,
        sender="a@example.com",
        recipients=("b@example.net",),
        body=b"Subject: x\r\n\r\nx\r\n",
        listener="relay",
    )


async def started_waker(db_url: str) -> QueueWaker:
    waker = QueueWaker(lambda: asyncpg.connect(db_url), retry_delay=0.2)
    waker.start()
    await asyncio.wait_for(waker.connected.wait(), 10)
    await waker.wait(0)  # consume the wake-up every (re)connect gives
    return waker


async def test_notify_wakes_a_waiting_worker(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    waker = await started_waker(db_url)
    try:
        waiting = asyncio.create_task(waker.wait(POLL))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        began = time.monotonic()
        await queue.enqueue(pool, mail(org_id))
        assert await asyncio.wait_for(waiting, POLL) is True
        assert time.monotonic() - began < POLL / 3
    finally:
        await waker.close()


async def test_poll_interval_ends_a_quiet_wait(db_url: str) -> None:
    waker = await started_waker(db_url)
    try:
        assert await waker.wait(0.3) is False
    finally:
        await waker.close()


async def test_killed_listen_connection_is_rebuilt(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    waker = await started_waker(db_url)
    try:
        conn = waker.connection
        assert conn is not None
        pid = conn.get_server_pid()
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        deadline = time.monotonic() + 15
        while waker.reconnects < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert waker.reconnects == 1
        assert waker.connection is not None and waker.connection.get_server_pid() != pid
        await waker.wait(0)
        waiting = asyncio.create_task(waker.wait(POLL))
        await asyncio.sleep(0.2)
        await queue.enqueue(pool, mail(org_id))
        assert await asyncio.wait_for(waiting, POLL) is True
    finally:
        await waker.close()


async def test_quiet_enqueue_plus_notify_sender_wakes_other_engines(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    from pigeon_mta.store.notify import NotifySender

    other = await started_waker(db_url)  # an engine in another process or node
    local = QueueWaker(lambda: asyncpg.connect(db_url))  # this process's engine (not listening)
    sender = NotifySender(pool, local)
    sender.start()
    try:
        waiting = asyncio.create_task(other.wait(POLL))
        await asyncio.sleep(0.2)
        for _ in range(50):
            await queue.enqueue(pool, mail(org_id), notify=False)
            sender.poke()
        assert await local.wait(0) is True, "the local engine is woken at once"
        assert await asyncio.wait_for(waiting, POLL) is True
        deadline = time.monotonic() + 10
        while sender.sent == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert 1 <= sender.sent <= 50, "pokes are coalesced, never dropped"
    finally:
        await sender.close()
        await other.close()


async def test_what_the_local_engine_takes_wakes_it_without_a_notify(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    from pigeon_mta.store.notify import NotifySender

    other = await started_waker(db_url)
    local = QueueWaker(lambda: asyncpg.connect(db_url))
    room = [3]

    def takes(deliveries: int) -> bool:
        if room[0] < deliveries:
            return False
        room[0] -= deliveries
        return True

    sender = NotifySender(pool, local, local_takes=takes)
    sender.start()
    try:
        await queue.enqueue(pool, mail(org_id), notify=False)
        sender.poke(2)
        assert await local.wait(0) is True, "the local engine is woken at once"
        assert await other.wait(0.5) is False, "no NOTIFY for what the local engine takes"
        assert (sender.sent, sender.left_local) == (0, 1)
        await queue.enqueue(pool, mail(org_id), notify=False)
        sender.poke(2)  # one more place only: the others are told
        assert await other.wait(POLL) is True
        deadline = time.monotonic() + 10
        while sender.sent == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (sender.sent, sender.left_local) == (1, 1)
    finally:
        await sender.close()
        await other.close()


async def test_quiet_enqueue_sends_no_notification(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    waker = await started_waker(db_url)
    try:
        await queue.enqueue(pool, mail(org_id), notify=False)
        assert await waker.wait(0.5) is False
    finally:
        await waker.close()
