"""Database trouble during a session: 451 4.3.0, nothing half-written, and recovery by itself.

client ──one SMTP session──► relay listener ──► PostgreSQL (backend killed / refusing connections)
"""

from __future__ import annotations

import asyncio
import smtplib
from pathlib import Path

import asyncpg

from tests.integration.submission_helpers import (
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
