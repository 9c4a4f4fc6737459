"""Replies that are not clean UTF-8 are recorded, never poison the engine's record step.

engine --SMTP (relayhost)--> HostileMx 127.0.0.2:<p> (tests/peers/hostile_mx.py): RCPT to latin1@
                              answered with Latin-1 bytes and a NUL
"""

from __future__ import annotations

import uuid

import asyncpg

from pigeon_mta.config import DeliverySettings, Duration, ServerSettings, Settings
from pigeon_mta.model import Reply, storable_text
from tests.conftest import free_port
from tests.integration.outbound_helpers import running_engine, send, wait_final
from tests.peers.hostile_mx import hostile_server


def test_storable_text() -> None:
    assert storable_text("Empf\udce4nger\x00 unbekannt") == "Empf\ufffdnger unbekannt"
    assert storable_text("plain") == "plain"
    # A surrogate that stands for no byte (JSON's "\\ud800") is replaced too, never raised on.
    assert storable_text("a\ud800b") == "a\ufffdb"
    assert storable_text(None) is None
    reply = Reply(550, "5.1.1", "caf\udce9")
    assert reply.storable().text == "caf\ufffd"


async def test_a_latin1_reply_with_a_nul_is_recorded_and_the_engine_keeps_going(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    port = free_port("127.0.0.2")
    server = await hostile_server("127.0.0.2", port, [])
    settings = Settings(
        server=ServerSettings(hostname="pigeon.test", node_name="hostile-test"),
        listener=(),
        delivery=DeliverySettings(
            relayhost=f"127.0.0.2:{port}",
            relayhost_tls="none",
            poll_interval=Duration(0.1),
            retry_initial=Duration(1),
            retry_max=Duration(2),
        ),
    )
    try:
        async with running_engine(settings, pool, db_url):
            first = await send(pool, org_id, "latin1@example.test", sender="")
            assert await wait_final(pool, first) == {"latin1@example.test": "bounced"}
            # The record step was not poisoned: the next message is recorded too.
            # (another address: the first one's bounce put it on the suppression list)
            second = await send(pool, org_id, "latin1@second.test", sender="")
            assert await wait_final(pool, second) == {"latin1@second.test": "bounced"}
    finally:
        server.close()
        await server.wait_closed()
    row = await pool.fetchrow(
        "SELECT last_code, last_response FROM recipient WHERE message_id = $1", first
    )
    assert row["last_code"] == 550
    assert "Empf\ufffdnger unbekannt" in row["last_response"]
    assert "\x00" not in row["last_response"]
