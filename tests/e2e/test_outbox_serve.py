"""An outbox under `pigeon-mta serve`: 5,000 rows an application committed are relayed by two
worker processes; every pigeon process is killed (SIGKILL) mid-relay and serve started again;
then the application's database is stopped for 10 s mid-relay. Every key is queued exactly once,
every row has its queue id, the sink has every message.

    app (asyncpg) --INSERT--> app database (private server, pigeon_outbox)
        serve, 2 workers --claim, write back--> app database
        serve --queue--> pigeon-mta's database --SMTP (relayhost)--> sink 127.0.0.2
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.e2e.relay_serve import pigeon_with, relay_config
from tests.e2e.serve_process import ServeProcess
from tests.peers.pg_cluster import LoneServer
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

FIRST = 5000
SECOND = 2000
MESSAGE_ID = re.compile(rb"Message-ID: <order-(\d+)@shop\.example>", re.IGNORECASE)


@pytest.fixture
async def app_server() -> AsyncIterator[LoneServer]:
    server = LoneServer()
    try:
        await asyncio.to_thread(server.start)
        admin = await asyncpg.connect(server.server_url(server.primary))
        try:
            await admin.execute("CREATE DATABASE shop")
        finally:
            await admin.close()
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def write_orders(url: str, first: int, last: int) -> None:
    """The application commits its orders' emails (one transaction, as a busy shop's batch)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            """INSERT INTO pigeon_outbox (idempotency_key, message)
               SELECT 'order-' || n, jsonb_build_object(
                   'from', 'shop@acme.example', 'to', jsonb_build_array('buyer@dest.test'),
                   'subject', 'order ' || n, 'text', 'Thank you.',
                   'headers', jsonb_build_object('Message-ID', '<order-' || n || '@shop.example>'))
               FROM generate_series($1::int, $2::int) AS n""",
            first,
            last,
        )
    finally:
        await conn.close()


async def relayed(url: str) -> int:
    """Rows relayed; -1 while the application's database is away."""
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return -1
    try:
        return int(
            await conn.fetchval("SELECT count(*) FROM pigeon_outbox WHERE relayed_at IS NOT NULL")
        )
    finally:
        await conn.close()


async def until_relayed(url: str, at_least: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (count := await relayed(url)) >= at_least:
            return count
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} rows relayed within {timeout}s")


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_every_key_is_queued_once_through_kill_9_and_a_stopped_app_database(
    tmp_path: Path, db_url: str, app_server: LoneServer
) -> None:
    app_url = app_server.server_url(app_server.primary, "shop")
    sink = SinkState(slow_seconds=0)
    server = await start_sink(sink, "127.0.0.2", 0)
    metrics_port = 0
    serve: ServeProcess | None = None
    try:
        config = relay_config(
            tmp_path,
            db_url,
            node_name="e2e-outbox",
            relayhost=f"127.0.0.2:{server.sockets[0].getsockname()[1]}",
            tables={"server": {"processes": 2}},
            outboxes=[{"name": "shop", "database": app_url, "org": "acme", "batch": 200}],
        )
        metrics_port = int(re.findall(r'listen = "127\.0\.0\.1:(\d+)"', config.read_text())[0])
        await pigeon_with(config, "org", "add", "acme")
        await pigeon_with(config, "domain", "add", "acme", "acme.example")
        printed = await pigeon_with(config, "outbox", "install", "shop", "--print")
        assert printed.startswith("CREATE TABLE IF NOT EXISTS pigeon_outbox (")
        assert "ready" in await pigeon_with(config, "outbox", "install", "shop")
        await write_orders(app_url, 1, FIRST)

        serve = ServeProcess("--config", str(config))
        for worker in (0, 1):
            await asyncio.to_thread(serve.wait_for, f"worker {worker} ready")
        # Killed mid-relay: rows relayed, rows claimed, messages committed but not written back.
        await until_relayed(app_url, 1000)
        await asyncio.to_thread(serve.kill)
        killed_at = await relayed(app_url)
        assert 1000 <= killed_at < FIRST, killed_at

        serve = ServeProcess("--config", str(config))
        await until_relayed(app_url, FIRST)
        await write_orders(app_url, FIRST + 1, FIRST + SECOND)
        await until_relayed(app_url, FIRST + 300)
        # The application's database stops for 10 s mid-relay: the node stays ready (its other
        # doors queue), /readyz says the outbox cannot reach it.
        await asyncio.to_thread(app_server.halt)
        stopped = time.monotonic()
        seen_warn = ""
        while time.monotonic() - stopped < 10:
            status, text = await asyncio.to_thread(readyz, metrics_port)
            if "outbox shop: WARN" in text:
                assert status == 200, text
                seen_warn = text
            await asyncio.sleep(0.5)
        assert seen_warn, "the outbox was never shown unreachable in /readyz"
        await asyncio.to_thread(app_server.restart)
        await until_relayed(app_url, FIRST + SECOND)
        listed = await pigeon_with(config, "outbox", "list", "--json")
        assert '"waiting": 0' in listed and '"refused": 0' in listed, listed

        # Exactly one message per key, and every row has its queue id.
        pigeon = await asyncpg.connect(db_url)
        app = await asyncpg.connect(app_url)
        try:
            queued = await pigeon.fetch(
                "SELECT id, header_message_id FROM message WHERE listener = 'outbox'"
            )
            rows = await app.fetch("SELECT idempotency_key, queue_id FROM pigeon_outbox")
        finally:
            await pigeon.close()
            await app.close()
        total = FIRST + SECOND
        assert len(queued) == total
        assert {r["header_message_id"] for r in queued} == {
            f"order-{n}@shop.example" for n in range(1, total + 1)
        }
        assert all(r["queue_id"] is not None for r in rows) and len(rows) == total
        assert {r["queue_id"] for r in rows} == {r["id"] for r in queued}

        # The sink has every message (at least once: a kill mid-delivery may send one again).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = {int(m.group(1)) for msg in sink.messages if (m := MESSAGE_ID.search(msg.data))}
            if len(got) == total:
                break
            await asyncio.sleep(0.2)
        assert got == set(range(1, total + 1))
        assert "Traceback" not in serve.output
    finally:
        if serve is not None:
            await asyncio.to_thread(serve.stop)
        await stop_servers([server])


def queued_by(port: int) -> float:
    """The node's pigeon_outbox_rows_total{outbox="shop",outcome="queued"}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(
        r'^pigeon_outbox_rows_total\{outbox="shop",outcome="queued"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


async def test_two_nodes_relaying_one_outbox_queue_each_key_once(
    tmp_path: Path, db_url: str, app_server: LoneServer
) -> None:
    app_url = app_server.server_url(app_server.primary, "shop")
    sink = SinkState(slow_seconds=0)
    server = await start_sink(sink, "127.0.0.2", 0)
    serves: list[ServeProcess] = []
    try:
        configs = []
        for node in ("a", "b"):
            (tmp_path / node).mkdir()
            configs.append(
                relay_config(
                    tmp_path / node,
                    db_url,
                    node_name=f"e2e-outbox-{node}",
                    relayhost=f"127.0.0.2:{server.sockets[0].getsockname()[1]}",
                    outboxes=[{"name": "shop", "database": app_url, "org": "acme", "batch": 50}],
                )
            )
        await pigeon_with(configs[0], "org", "add", "acme")
        await pigeon_with(configs[0], "domain", "add", "acme", "acme.example")
        await pigeon_with(configs[0], "outbox", "install", "shop")
        for config in configs:
            serves.append(ServeProcess("--config", str(config)))
        for serve in serves:
            await asyncio.to_thread(serve.wait_for, "worker 0 ready")
        await write_orders(app_url, 1, 3000)
        await until_relayed(app_url, 3000)
        ports = [
            int(re.findall(r'listen = "127\.0\.0\.1:(\d+)"', c.read_text())[0]) for c in configs
        ]
        counts = [await asyncio.to_thread(queued_by, p) for p in ports]
        assert all(counts) and sum(counts) == 3000, counts  # both relayed, each row once
        pigeon = await asyncpg.connect(db_url)
        try:
            keys = await pigeon.fetchval(
                "SELECT count(DISTINCT header_message_id) FROM message WHERE listener = 'outbox'"
            )
            messages = await pigeon.fetchval(
                "SELECT count(*) FROM message WHERE listener = 'outbox'"
            )
        finally:
            await pigeon.close()
        assert (keys, messages) == (3000, 3000)
    finally:
        for serve in serves:
            await asyncio.to_thread(serve.stop)
        await stop_servers([server])
