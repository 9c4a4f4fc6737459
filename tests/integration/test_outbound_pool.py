"""Connection reuse and traffic shaping, counted at the sink.

engine --(pooled SMTP connections)--> sink 127.0.0.2 (mx1.order.test)
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.config import DestinationSettings
from pigeon_mta.metrics import OUTBOUND_CONNECTION_REUSES, OUTBOUND_CONNECTIONS_OPEN
from pigeon_mta.model import Envelope
from pigeon_mta.outbound.connect import ConnectionKey, ConnectOptions, open_connection
from pigeon_mta.store import queue
from tests.integration.outbound_helpers import BODY, running_engine, wait_until
from tests.peers.world import World, mail_world


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with mail_world(tmp_path) as w:
        yield w


async def queue_many(pool: asyncpg.Pool, org_id: uuid.UUID, addresses: list[str]) -> None:
    for address in addresses:
        await queue.enqueue(
            pool,
            Envelope(
                org_id=org_id,
                sender="a@sender.test",
                recipients=(address,),
                body=BODY,
                listener="t",
            ),
        )


async def count_status(pool: asyncpg.Pool, status: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM recipient WHERE status = $1", status))


async def test_200_messages_to_one_destination_share_the_configured_connections(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, max_connections_per_host=3, max_messages_per_connection=1000)
    reuses_before = OUTBOUND_CONNECTION_REUSES._value.get()
    await queue_many(pool, org_id, [f"user{i}@order.test" for i in range(200)])
    async with running_engine(settings, pool, db_url) as engine:

        async def all_delivered() -> bool:
            return await count_status(pool, "delivered") == 200

        await wait_until(all_delivered, 60, "200 deliveries")
        assert engine.connections.open_connections <= 3
    assert len(world.sinks.messages) == 200
    assert world.sinks.connections["127.0.0.2"] <= 3
    assert OUTBOUND_CONNECTION_REUSES._value.get() - reuses_before >= 197
    assert OUTBOUND_CONNECTIONS_OPEN._value.get() == 0  # all closed on stop


async def test_a_connection_carries_at_most_max_messages_per_connection(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, max_connections_per_host=1, max_messages_per_connection=5)
    await queue_many(pool, org_id, [f"user{i}@order.test" for i in range(20)])
    async with running_engine(settings, pool, db_url):

        async def all_delivered() -> bool:
            return await count_status(pool, "delivered") == 20

        await wait_until(all_delivered, 60, "20 deliveries")
    assert world.sinks.connections["127.0.0.2"] == 4


async def test_destination_concurrency_limit_caps_transactions_in_flight(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    world.sinks.slow_seconds = 0.3
    settings = world.settings(
        db_url, destination={"order.test": DestinationSettings(concurrency=2)}
    )
    await queue_many(pool, org_id, [f"slow+{i}@order.test" for i in range(8)])
    async with running_engine(settings, pool, db_url):

        async def all_delivered() -> bool:
            return await count_status(pool, "delivered") == 8

        await wait_until(all_delivered, 60, "8 deliveries")
    assert world.sinks.max_in_flight == 2


async def test_an_mx_pattern_groups_domains_under_one_limit(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    # order.test (MX mx1.order.test) and plain.test (MX mx.plain.test) both match one MX-name
    # pattern, so they share one concurrency limit of 1, counted at their common sink.
    world.sinks.slow_seconds = 0.2
    settings = world.settings(
        db_url, destination={"mx*.*.test": DestinationSettings(concurrency=1)}
    )
    await queue_many(
        pool,
        org_id,
        [f"slow+{i}@order.test" for i in range(3)] + [f"slow+{i}@plain.test" for i in range(3)],
    )
    async with running_engine(settings, pool, db_url):

        async def all_delivered() -> bool:
            return await count_status(pool, "delivered") == 6

        await wait_until(all_delivered, 60, "6 deliveries")
    assert world.sinks.max_in_flight == 1


async def test_a_rate_limited_destination_postpones_mail_without_counting_attempts(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(
        db_url,
        throttle_wait=0.2,
        destination={"order.test": DestinationSettings(rate=4, burst=2)},
    )
    await queue_many(pool, org_id, [f"user{i}@order.test" for i in range(10)])
    async with running_engine(settings, pool, db_url):

        async def all_delivered() -> bool:
            return await count_status(pool, "delivered") == 10

        await wait_until(all_delivered, 60, "10 deliveries")
    # Postponed claims were handed back unattempted: one attempt each, no deferrals logged.
    rows = await pool.fetch("SELECT attempts FROM recipient")
    assert {r["attempts"] for r in rows} == {1}
    assert await pool.fetchval("SELECT count(*) FROM attempt WHERE outcome <> 'delivered'") == 0
    assert len(world.sinks.messages) == 10


async def test_graceful_stop_puts_unfinished_recipients_back_in_the_queue_at_once(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    world.sinks.slow_seconds = 0.3
    await queue_many(pool, org_id, ["hang+1@order.test", "hang+2@order.test", "slow@order.test"])
    settings = world.settings(db_url)
    async with running_engine(settings, pool, db_url) as engine:
        await world.sinks.wait_for(
            lambda: (
                world.sinks.rcpt_commands["hang+1@order.test"]
                and world.sinks.rcpt_commands["hang+2@order.test"]
                and world.sinks.rcpt_commands["slow@order.test"]
            )
        )
        await engine.stop(asyncio.get_running_loop().time() + 3)
        rows = {
            r["address"]: r
            for r in await pool.fetch("SELECT *, next_attempt_at <= now() AS due FROM recipient")
        }
    # The transaction that could finish did; the hung ones were handed back, due now, untried.
    assert rows["slow@order.test"]["status"] == "delivered"
    for address in ("hang+1@order.test", "hang+2@order.test"):
        row = rows[address]
        assert (row["status"], row["attempts"], row["lease_owner"], row["due"]) == (
            "queued",
            0,
            None,
            True,
        )


async def test_a_transaction_broken_off_gives_its_connection_back_to_the_pool(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """A transaction cut short by something other than an SMTP error (here, the stop deadline
    cancelling a hung one) still returns its connection: a connection kept by a dead task would
    hold its host's only slot, and every later message to that host would wait for ever."""
    settings = world.settings(db_url, max_connections_per_host=1)
    await queue_many(pool, org_id, ["hang@order.test"])
    async with running_engine(settings, pool, db_url) as engine:
        await world.sinks.wait_for(lambda: world.sinks.rcpt_commands["hang@order.test"])
        assert engine.connections.open_connections == 1
        await engine.stop(asyncio.get_running_loop().time() + 3)
        assert engine.connections.open_connections == 0


async def test_an_engine_full_of_hung_transactions_takes_nothing_more(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """Its listeners then NOTIFY the other processes and nodes (NotifySender asks `takes`)."""
    settings = world.settings(db_url, concurrency=2, max_org_share=1.0)  # one org may fill it
    async with running_engine(settings, pool, db_url) as engine:
        await asyncio.sleep(0.3)
        assert engine.takes(1) is True
        await queue_many(pool, org_id, ["hang+1@order.test", "hang+2@order.test"])
        engine.waker.wake()  # type: ignore[union-attr]
        await world.sinks.wait_for(
            lambda: (
                world.sinks.rcpt_commands["hang+1@order.test"]
                and world.sinks.rcpt_commands["hang+2@order.test"]
            )
        )
        assert engine.in_flight == 2
        assert engine.takes(1) is False
        await engine.stop(asyncio.get_running_loop().time() + 3)


async def test_stop_hands_back_mail_waiting_for_its_destination_without_delay(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(
        db_url, throttle_wait=60, destination={"order.test": DestinationSettings(concurrency=1)}
    )
    await queue_many(pool, org_id, ["hang@order.test", "waiting@order.test"])
    async with running_engine(settings, pool, db_url) as engine:
        await world.sinks.wait_for(lambda: world.sinks.rcpt_commands["hang@order.test"])
        await engine.stop(asyncio.get_running_loop().time() + 3)
    rows = await pool.fetch("SELECT address, status, attempts FROM recipient ORDER BY address")
    assert [tuple(r) for r in rows] == [
        ("hang@order.test", "queued", 0),
        ("waiting@order.test", "queued", 0),
    ]
    assert world.sinks.rcpt_commands["waiting@order.test"] == 0


async def test_idle_connections_are_closed_after_the_idle_timeout(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, idle_timeout=1)
    await queue_many(pool, org_id, ["bob@order.test"])
    async with running_engine(settings, pool, db_url) as engine:

        async def delivered() -> bool:
            return await count_status(pool, "delivered") == 1

        await wait_until(delivered, 30, "a delivery")
        assert engine.connections.open_connections == 1

        async def closed() -> bool:
            return engine.connections.open_connections == 0

        await wait_until(closed, 30, "the idle connection to close")


async def test_client_connections_set_tcp_nodelay(world: World) -> None:
    options = ConnectOptions("pigeon.test", connect_timeout=5, command_timeout=5)
    conn = await open_connection(
        ConnectionKey("mx1.order.test", "127.0.0.2", world.port, "none"), options
    )
    try:
        sock = conn.client.get_transport_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        await conn.quit()


async def test_domains_with_one_mx_host_share_its_connections(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    # order.test and bücher.test both have MX mx1.order.test: connections are pooled by the host
    # that receives the mail (as KumoMTA pools by site), so one connection carries both.
    settings = world.settings(db_url, max_connections_per_host=1, max_messages_per_connection=1000)
    await queue_many(
        pool,
        org_id,
        [f"user{i}@order.test" for i in range(5)]
        + [f"user{i}@xn--bcher-kva.test" for i in range(5)],
    )
    async with running_engine(settings, pool, db_url):

        async def all_delivered() -> bool:
            return await count_status(pool, "delivered") == 10

        await wait_until(all_delivered, 60, "10 deliveries")
    assert len(world.sinks.messages) == 10
    assert world.sinks.connections["127.0.0.2"] == 1
