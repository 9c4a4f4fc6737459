"""Database trouble during a session: 451 4.3.0, nothing half-written, and recovery by itself.

client ──one SMTP session──► relay listener ──► PostgreSQL (backend killed / refusing connections)
"""

from __future__ import annotations

import asyncio
import json
import smtplib
import socket
import threading
from pathlib import Path

import asyncpg

from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.intake.accept import Intake
from pigeon_mta.store import connect as store_connect
from pigeon_mta.submission.service import SubmissionService
from tests.integration.submission_helpers import (
    TRUSTED_CLIENT,
    make_settings,
    make_tls,
    message,
    message_rows,
    running_service,
    smtp_client,
)


def send(client: smtplib.SMTP, subject: str) -> tuple[int, bytes]:
    code, text = client.mail("app@host.internal")
    assert code == 250, text
    code, text = client.rcpt(f"{subject}@example.net")
    assert code == 250, text
    return client.data(message("app@host.internal", "x", subject=subject))


async def orphan_rows(pool: asyncpg.Pool) -> int:
    """Messages without recipients or recipients without messages: a half-written enqueue."""
    return int(
        await pool.fetchval(
            """SELECT (SELECT count(*) FROM message m
                       WHERE NOT EXISTS (SELECT 1 FROM recipient r WHERE r.message_id = m.id))
                    + (SELECT count(*) FROM recipient r
                       WHERE NOT EXISTS (SELECT 1 FROM message m WHERE m.id = r.message_id))"""
        )
    )


async def test_backend_killed_during_the_commit(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("relay",))
    async with running_service(settings, pool) as running:
        client = await asyncio.to_thread(smtp_client, running.port("relay"))
        try:
            await asyncio.to_thread(client.ehlo)
            first = await asyncio.to_thread(send, client, "first")
            assert first[0] == 250
            # Hold the org row so the next enqueue stops half-way (its message row is written,
            # its foreign-key check waits), then kill that backend.
            blocker = await asyncpg.connect(db_url)
            try:
                lock = blocker.transaction()
                await lock.start()
                await blocker.execute("SELECT * FROM org WHERE name = 'internal' FOR UPDATE")
                second_task = asyncio.create_task(asyncio.to_thread(send, client, "second"))
                killed = False
                for _ in range(1500):
                    killed = bool(
                        await blocker.fetchval(
                            """SELECT bool_or(pg_terminate_backend(pid)) FROM pg_stat_activity
                               WHERE datname = current_database() AND pid <> pg_backend_pid()
                                 AND wait_event_type = 'Lock'"""
                        )
                    )
                    if killed:
                        break
                    await asyncio.sleep(0.02)
                assert killed, "the enqueue never waited on the lock"
                second = await second_task
                await lock.rollback()
            finally:
                await blocker.close()
            third = await asyncio.to_thread(send, client, "third")
            await asyncio.to_thread(client.quit)
        finally:
            client.close()
    assert second == (451, b"4.3.0 Temporary failure queueing the message, try again later")
    assert third[0] == 250
    rows = await message_rows(pool)
    assert [r["recipients"] for r in rows] == [["first@example.net"], ["third@example.net"]]
    assert await orphan_rows(pool) == 0


async def test_database_refusing_connections_then_back(
    tmp_path: Path, db_url: str, admin_url: str, pool: asyncpg.Pool
) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("relay",))
    name = db_url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(admin_url)
    try:
        async with running_service(settings, pool) as running:
            client = await asyncio.to_thread(smtp_client, running.port("relay"))
            try:
                await asyncio.to_thread(client.ehlo)
                assert (await asyncio.to_thread(send, client, "before"))[0] == 250
                await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                    name,
                )
                down = await asyncio.to_thread(send, client, "down")
                await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
                after = await asyncio.to_thread(send, client, "after")
            finally:
                client.close()
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
    assert down[0] == 451 and down[1].startswith(b"4.3.0 ")
    assert after[0] == 250
    rows = await message_rows(pool)
    assert [r["recipients"] for r in rows] == [["before@example.net"], ["after@example.net"]]
    assert await orphan_rows(pool) == 0


async def test_a_message_committed_after_its_client_hung_up_is_announced(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """The client hangs up while the commit waits on a lock; the commit then succeeds. The
    message is queued, so the engines are woken and its Reception record is written as for any
    other (it used to wait for the poll and leave no Reception record)."""
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("relay",))
    log_path = tmp_path / "delivery.log"
    delivery_log = DeliveryLog.open(str(log_path))
    pokes: list[int] = []
    service = SubmissionService(
        settings,
        pool,
        Intake.of(settings, pool, delivery_log=delivery_log, on_queued=pokes.append),
    )
    await service.start()
    await service.intake.trusted_org()  # the org row exists, so the lock below holds it
    blocker = await asyncpg.connect(db_url)
    try:
        lock = blocker.transaction()
        await lock.start()
        await blocker.execute("SELECT * FROM org WHERE name = 'internal' FOR UPDATE")

        committing = threading.Event()

        def send_and_hang_up() -> None:
            address = ("127.0.0.1", service.bound["relay"][1])
            with socket.create_connection(address, source_address=(TRUSTED_CLIENT, 0)) as s:
                s.settimeout(10)
                body = message("app@host.internal", "x", subject="orphan").replace(b"\n.", b"\n..")
                s.sendall(
                    b"EHLO client.test\r\nMAIL FROM:<app@host.internal>\r\n"
                    b"RCPT TO:<orphan@example.net>\r\nDATA\r\n" + body + b"\r\n.\r\n"
                )
                assert committing.wait(10), "the enqueue never waited on the lock"
            # closed here: the client is gone before the commit could finish

        hang_up = asyncio.create_task(asyncio.to_thread(send_and_hang_up))
        waiting = 0
        for _ in range(500):
            waiting = await blocker.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
            if waiting:
                break
            await asyncio.sleep(0.02)
        committing.set()
        await hang_up
        assert waiting, "the enqueue never waited on the lock"
        await asyncio.sleep(0.3)  # the server notices the hang-up
        assert pokes == []
        await lock.rollback()
        for _ in range(500):
            if pokes and log_path.exists() and log_path.read_text():
                break
            await asyncio.sleep(0.02)
    finally:
        await blocker.close()
        await service.stop(asyncio.get_running_loop().time() + 5)
        delivery_log.close()
    rows = await message_rows(pool)
    assert len(rows) == 1
    assert pokes == [1]
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["type"], r["queue_id"], r["recipient"]) for r in records] == [
        ("Reception", str(rows[0]["id"]), "orphan@example.net")
    ]


async def test_messages_commit_on_their_own_connections_while_the_main_pool_is_taken(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """A worker commits accepted mail on its commit pool (store.connect.commit_pool): with every
    connection of its main pool held (by a slow engine round, say), a message still gets its 250
    and is queued; and those commit connections plan generically, where the main pool's plan each
    statement for its parameters (store.connect.server_settings)."""
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("relay",))
    main = await store_connect.create_pool(db_url, settings, size=1)
    commits = await store_connect.commit_pool(db_url, settings)
    service = SubmissionService(settings, main, Intake.of(settings, main, commit_pool=commits))
    await service.start()
    try:
        await service.intake.trusted_org()  # looked up once, on the main pool
        async with main.acquire() as held:
            assert await held.fetchval("SHOW plan_cache_mode") == "force_custom_plan"

            def deliver() -> tuple[int, bytes]:
                with smtp_client(service.bound["relay"][1], timeout=10) as client:
                    client.ehlo("client.test")
                    return send(client, "taken")

            code, text = await asyncio.wait_for(asyncio.to_thread(deliver), 15)
            assert code == 250, text
        assert await commits.fetchval("SHOW plan_cache_mode") == "auto"
        rows = await message_rows(pool)
        assert [r["recipients"] for r in rows] == [["taken@example.net"]]
    finally:
        await service.stop(asyncio.get_running_loop().time() + 5)
        await commits.close()
        await main.close()
