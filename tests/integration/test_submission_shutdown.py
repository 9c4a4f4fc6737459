"""Stopping the listeners: idle clients are told 421 at once, a commit under way finishes and its
client gets its 250, no new connection is taken.

idle client ─┐
busy client ─┼─SMTP──► relay listener ──► PostgreSQL (the busy client's commit held on a lock)
new client  ─┘
"""

from __future__ import annotations

import asyncio
import smtplib
import socket
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.store.orgs import ensure_org
from tests.integration.submission_helpers import (
    make_settings,
    make_tls,
    message,
    message_rows,
    running_service,
    smtp_client,
)


def rest_of(client: smtplib.SMTP) -> bytes:
    """What the server says before it hangs up."""
    assert client.sock is not None
    client.sock.settimeout(30)
    received = b""
    while chunk := client.sock.recv(4096):
        received += chunk
    return received


async def test_stop_drains_commits_and_refuses_new_work(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("relay",))
    await ensure_org(pool, "internal")  # (serve creates it on start)
    async with running_service(settings, pool) as running:
        port = running.port("relay")
        idle = await asyncio.to_thread(smtp_client, port)
        busy = await asyncio.to_thread(smtp_client, port)
        await asyncio.to_thread(idle.ehlo)
        await asyncio.to_thread(busy.ehlo)
        blocker = await asyncpg.connect(db_url)
        try:
            hold = blocker.transaction()
            await hold.start()
            await blocker.execute("SELECT * FROM org WHERE name = 'internal' FOR UPDATE")

            def send() -> tuple[int, bytes]:
                busy.mail("app@host.internal")
                busy.rcpt("bob@example.net")
                return busy.data(message("app@host.internal", "bob@example.net"))

            sending = asyncio.create_task(asyncio.to_thread(send))
            for _ in range(1500):
                if await blocker.fetchval(
                    """SELECT count(*) FROM pg_stat_activity
                       WHERE datname = current_database() AND wait_event_type = 'Lock'"""
                ):
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the commit never waited on the lock")
            stopping = asyncio.create_task(
                running.service.stop(asyncio.get_running_loop().time() + 30)
            )
            idle_said = await asyncio.to_thread(rest_of, idle)
            with pytest.raises(ConnectionRefusedError):
                await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
            assert not stopping.done()  # still waiting for the commit
            await hold.rollback()
        finally:
            await blocker.close()
        code, reply = await sending
        busy_said = await asyncio.to_thread(rest_of, busy)
        await asyncio.wait_for(stopping, 30)
    assert idle_said == b"421 4.3.2 mta.test Service shutting down, try again later\r\n"
    assert code == 250 and b"queued as" in reply
    assert busy_said == b"421 4.3.2 mta.test Service shutting down, try again later\r\n"
    assert [r["recipients"] for r in await message_rows(pool)] == [["bob@example.net"]]
