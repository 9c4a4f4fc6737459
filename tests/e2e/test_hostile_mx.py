"""A hostile MX against the real `pigeon-mta serve` (one process, the reported reproduction):
nothing it answers stops the worker's record, and nothing is sent twice across a restart.

test --SQL--> PostgreSQL <--claim/record-- pigeon-mta serve (processes = 1)
                                               \\--SMTP (relayhost)--> hostile MX 127.0.0.2
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import asyncpg

from tests.conftest import free_port
from tests.e2e.test_outbound_engine import start_engine
from tests.integration.outbound_helpers import send, wait_final
from tests.peers.hostile_mx import hostile_server


async def test_a_poison_reply_stops_no_outcome_and_a_restart_sends_nothing_again(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    port = free_port("127.0.0.2")
    delivered: list[bytes] = []
    server = await hostile_server("127.0.0.2", port, delivered)
    try:
        serve = await start_engine(tmp_path / "a", db_url, "node-a", port)
        try:
            poisoned = [
                await send(pool, org_id, "poison-digit@example.test"),
                await send(pool, org_id, "poison-digit@example.test", sender="jürgen@own.test"),
                await send(pool, org_id, "poison-digit-temp@example.test"),
            ]
            healthy = [await send(pool, org_id, f"ok{i}@example.test") for i in range(20)]
            for message_id in healthy:
                assert set((await wait_final(pool, message_id, timeout=30)).values()) == {
                    "delivered"
                }
            for message_id in poisoned[:2]:
                assert set((await wait_final(pool, message_id, timeout=30)).values()) == {"bounced"}
            # The temporary one is deferred, recorded: queued again with its reply.
            row = await pool.fetchrow(
                "SELECT status, attempts, last_code, last_response FROM recipient "
                "WHERE message_id = $1",
                poisoned[2],
            )
            assert row["last_code"] == 450 and row["attempts"] >= 1
            assert "\u0661" in row["last_response"]
        finally:
            assert await asyncio.to_thread(serve.stop, signal.SIGTERM, 60) == 0, serve.output
        first_run = serve.output
        before = sorted(d for d in delivered if d.startswith(b"ok"))
        assert before == sorted(f"ok{i}".encode() for i in range(20))
        # A restart finds nothing delivered but unrecorded: nothing is sent again.
        again = await start_engine(tmp_path / "b", db_url, "node-a", port)
        try:
            await asyncio.sleep(3)
        finally:
            assert await asyncio.to_thread(again.stop, signal.SIGTERM, 60) == 0, again.output
    finally:
        server.close()
        await server.wait_closed()
    assert sorted(d for d in delivered if d.startswith(b"ok")) == before
    assert "Traceback" not in first_run and "could not record" not in first_run, first_run
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivering'") == 0
    dsns = await pool.fetch(
        "SELECT r.address FROM message m JOIN recipient r ON r.message_id = m.id "
        "WHERE m.sender = '' ORDER BY r.address"
    )
    assert [r["address"] for r in dsns] == ["alice@sender.test", "jürgen@own.test"]
