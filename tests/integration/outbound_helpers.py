"""Helpers for outbound tests: queue a message, run an engine, wait for the queue to settle."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.model import FINAL_STATUSES, Envelope
from pigeon_mta.outbound.engine import DeliveryEngine
from pigeon_mta.store import queue

BODY = b"From: a@sender.test\r\nTo: b@example.test\r\nSubject: test\r\n\r\nHello.\r\n"


async def send(
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    *recipients: str,
    sender: str = "alice@sender.test",
    body: bytes = BODY,
) -> uuid.UUID:
    return await queue.enqueue(
        pool,
        Envelope(
            org_id=org_id,
            sender=sender,
            recipients=recipients,
            body=body,
            listener="test",
            header_message_id=f"{uuid.uuid4()}@sender.test",
        ),
    )


@asynccontextmanager
async def running_engine(
    settings: Settings, pool: asyncpg.Pool, db_url: str, **kwargs: Any
) -> AsyncIterator[DeliveryEngine]:
    engine = DeliveryEngine(settings, pool, listen=lambda: asyncpg.connect(db_url), **kwargs)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop(asyncio.get_running_loop().time() + 10)


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout: float = 30, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.05)


async def statuses(pool: asyncpg.Pool, message_id: uuid.UUID) -> dict[str, str]:
    rows = await pool.fetch(
        "SELECT address, status FROM recipient WHERE message_id = $1", message_id
    )
    return {r["address"]: r["status"] for r in rows}


async def wait_final(
    pool: asyncpg.Pool, message_id: uuid.UUID, timeout: float = 30
) -> dict[str, str]:
    """Wait until every recipient of the message has a final status; returns them."""

    async def done() -> bool:
        return all(s in FINAL_STATUSES for s in (await statuses(pool, message_id)).values())

    await wait_until(done, timeout, f"final status for message {message_id}")
    return await statuses(pool, message_id)


async def wait_attempts(
    pool: asyncpg.Pool, message_id: uuid.UUID, count: int, timeout: float = 30
) -> list[asyncpg.Record]:
    """Wait until the message has at least `count` attempt rows; returns them in order."""

    async def enough() -> bool:
        n = await pool.fetchval("SELECT count(*) FROM attempt WHERE message_id = $1", message_id)
        return int(n) >= count

    await wait_until(enough, timeout, f"{count} attempt(s) for message {message_id}")
    return await attempts(pool, message_id)


async def attempts(pool: asyncpg.Pool, message_id: uuid.UUID) -> list[asyncpg.Record]:
    return await pool.fetch(
        """SELECT a.*, r.address FROM attempt a JOIN recipient r ON r.id = a.recipient_id
           WHERE a.message_id = $1 ORDER BY a.recorded_at, r.address""",
        message_id,
    )
