"""The delivery engine inside the real `pigeon-mta serve` (engine only: `listener = []`).

test --SQL--> PostgreSQL <--claim/record-- pigeon-mta serve (1..3 processes, one node each)
                                               \\--SMTP--> sink 127.0.0.2 (in the test)
"""

from __future__ import annotations

import asyncio
import collections
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers


@pytest.fixture
async def sink() -> AsyncIterator[tuple[SinkState, int]]:
    state = SinkState(slow_seconds=1.0)
    server = await start_sink(state, "127.0.0.2")
    try:
        yield state, server.sockets[0].getsockname()[1]
    finally:
        await stop_servers([server])


def engine_config(
    directory: Path, db_url: str, node: str, sink_port: int, *, delivery: str = ""
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_config(
        directory,
        f"""listener = []
[server]
node_name = "{node}"
hostname = "{node}.test"
data_dir = "{directory}"
processes = 1
shutdown_timeout = "3s"
[database]
url = "{db_url}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
relayhost = "127.0.0.2:{sink_port}"
lease = "5s"
sweep_interval = "1s"
poll_interval = "200ms"
retry_initial = "1s"
retry_max = "2s"
{delivery}
""",
    )


async def start_engine(
    directory: Path, db_url: str, node: str, port: int, **kw: str
) -> ServeProcess:
    serve = ServeProcess("--config", str(engine_config(directory, db_url, node, port, **kw)))
    await asyncio.to_thread(serve.wait_for, "delivery engine started", 60)
    return serve


async def queue_messages(
    pool: asyncpg.Pool, org_id: uuid.UUID, local: str, messages: int, per_message: int = 1
) -> None:
    """`messages` messages with `per_message` recipients each at dest.test, in one statement."""
    await pool.execute(
        """
        WITH m AS (
            -- Each message its own arrival time, a millisecond apart, as if sent one by one.
            INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
            SELECT gen_random_uuid(), $1, 'sender@example.com', 30,
                   'Subject: t\r\n\r\nbody\r\n', 'test',
                   now() - make_interval(secs => ($2 - i) / 1000.0)
            FROM generate_series(1, $2) AS i
            RETURNING id, received_at
        ), r AS (
            INSERT INTO recipient (id, message_id, org_id, address, domain, created_at,
                                   next_attempt_at)
            SELECT gen_random_uuid(), m.id, $1, $3 || '+' || n || '-' || m.id || '@dest.test',
                   'dest.test', m.received_at, m.received_at
            FROM m CROSS JOIN LATERAL generate_series(1, $4) AS n
        )
        SELECT pg_notify('pigeon_queue', '')
        """,
        org_id,
        messages,
        local,
        per_message,
    )


async def status_counts(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT status, count(*) AS n FROM recipient GROUP BY status")
    return {r["status"]: r["n"] for r in rows}


async def wait_all_delivered(pool: asyncpg.Pool, total: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (await status_counts(pool)).get("delivered", 0) < total:
        if loop.time() > deadline:
            raise AssertionError(f"not all delivered: {await status_counts(pool)}")
        await asyncio.sleep(0.2)


async def stop(serve: ServeProcess) -> int:
    return await asyncio.to_thread(serve.stop, signal.SIGTERM, 60)


@pytest.mark.slow
async def test_after_kill_9_mid_batch_and_lease_expiry_every_recipient_is_delivered(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID, sink: tuple[SinkState, int]
) -> None:
    state, port = sink
    limit = "destination_concurrency = 4\n"
    await queue_messages(pool, org_id, "slow", 16)
    first = await start_engine(tmp_path / "a", db_url, "node-a", port, delivery=limit)
    try:
        # The first transactions finished; others are in flight at the sink.
        await state.wait_for(lambda: len(state.messages) >= 2 and state.in_flight >= 1)
    finally:
        first.kill()
    in_flight = await status_counts(pool)
    assert in_flight.get("delivering", 0) >= 1, in_flight
    # Another node takes over: it must wait for node-a's leases to run out (5s).
    second = await start_engine(tmp_path / "b", db_url, "node-b", port, delivery=limit)
    try:
        await wait_all_delivered(pool, 16, timeout=60)
    finally:
        assert await stop(second) == 0, second.output
    deliveries = state.deliveries()
    assert len(deliveries) == 16 and min(deliveries.values()) >= 1
    lost = await pool.fetchval(
        "SELECT count(*) FROM attempt WHERE response LIKE 'lease of node-a/% ended%'"
    )
    assert lost >= in_flight["delivering"]


@pytest.mark.slow
async def test_three_engines_on_one_database_deliver_10000_recipients_none_twice(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID, sink: tuple[SinkState, int]
) -> None:
    state, port = sink
    engines = [
        await start_engine(tmp_path / node, db_url, node, port)
        for node in ("node-a", "node-b", "node-c")
    ]
    try:
        await queue_messages(pool, org_id, "user", 2000, per_message=5)
        await wait_all_delivered(pool, 10_000, timeout=180)
    finally:
        codes = [await stop(engine) for engine in engines]
    assert codes == [0, 0, 0], [e.output for e in engines]
    deliveries = state.deliveries()
    assert len(deliveries) == 10_000
    assert collections.Counter(deliveries.values()) == {1: 10_000}
    # Every node did part of the work, mostly one transaction per message (a claim's batch
    # boundary may split a message's recipients into two transactions).
    by_node = collections.Counter(m.helo for m in state.messages)
    assert set(by_node) == {"node-a.test", "node-b.test", "node-c.test"}, by_node
    assert sum(by_node.values()) < 3000, by_node


async def test_sigterm_puts_unfinished_recipients_back_in_the_queue_at_once(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID, sink: tuple[SinkState, int]
) -> None:
    state, port = sink
    await queue_messages(pool, org_id, "hang", 3)
    serve = await start_engine(tmp_path, db_url, "node-a", port)
    try:
        await state.wait_for(lambda: len(state.rcpt_commands) == 3)
    finally:
        code = await stop(serve)
    assert code == 0, serve.output
    rows = await pool.fetch(
        "SELECT status, attempts, lease_owner, next_attempt_at <= now() AS due FROM recipient"
    )
    assert [tuple(r) for r in rows] == [("queued", 0, None, True)] * 3
    assert "3 unfinished recipient(s) are queued again" in serve.output
