"""An outcome that cannot be recorded as it is never stops the others of its worker.

engine --SMTP (relayhost)--> raw server on 127.0.0.2:<p>: RCPT to poison-*@ is answered with a
                              hostile reply (a Unicode digit in the enhanced code, a 32 KB line),
                              every other RCPT with 250, the final dot with 250
"""

from __future__ import annotations

import uuid

import asyncpg

from pigeon_mta.config import DeliverySettings, Duration, ServerSettings, Settings
from pigeon_mta.model import Status
from tests.conftest import free_port
from tests.integration.outbound_helpers import running_engine, send, wait_final
from tests.peers.hostile_mx import hostile_server


def _settings(port: int) -> Settings:
    return Settings(
        server=ServerSettings(hostname="pigeon.test", node_name="poison-test"),
        listener=(),
        delivery=DeliverySettings(
            relayhost=f"127.0.0.2:{port}",
            relayhost_tls="none",
            poll_interval=Duration(0.1),
            retry_initial=Duration(1),
            retry_max=Duration(2),
        ),
    )


async def test_a_unicode_digit_and_a_utf8_sender_stop_no_other_outcome(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    port = free_port("127.0.0.2")
    delivered: list[bytes] = []
    server = await hostile_server("127.0.0.2", port, delivered)
    try:
        async with running_engine(_settings(port), pool, db_url):
            poisoned = [
                await send(pool, org_id, "poison-digit@example.test"),
                await send(pool, org_id, "poison-long@example.test"),
                # A bounce to an SMTPUTF8 sender: its DSN's To: is not ASCII.
                await send(pool, org_id, "poison-digit@example.test", sender="jürgen@own.test"),
            ]
            healthy = [await send(pool, org_id, f"ok{i}@example.test") for i in range(20)]
            for message_id in healthy:
                assert await wait_final(pool, message_id, timeout=10) == {
                    f"ok{healthy.index(message_id)}@example.test": "delivered"
                }
            for message_id in poisoned:
                assert set((await wait_final(pool, message_id, timeout=10)).values()) == {"bounced"}
    finally:
        server.close()
        await server.wait_closed()
    # Each healthy recipient got the message once (the DSNs went to the same server).
    assert sorted(d for d in delivered if d.startswith(b"ok")) == sorted(
        f"ok{i}".encode() for i in range(20)
    )
    long_line = await pool.fetchval(
        "SELECT max(length(last_response)) FROM recipient WHERE address = 'poison-long@example.test'"
    )
    assert long_line > 2000
    # The bounces owed to the senders are queued, the UTF-8 one included.
    dsns = await pool.fetch(
        "SELECT r.address, m.body FROM message m JOIN recipient r ON r.message_id = m.id "
        "WHERE m.sender = '' ORDER BY r.address"
    )
    assert sorted(r["address"] for r in dsns) == [
        "alice@sender.test",
        "alice@sender.test",
        "jürgen@own.test",
    ]
    for row in dsns:
        head = bytes(row["body"]).split(b"\r\n\r\n", 1)[0]
        assert max(len(line) for line in bytes(row["body"]).split(b"\r\n")) <= 998
        assert b"Status: 5." in bytes(row["body"])
        if row["address"] == "jürgen@own.test":
            assert "To: <jürgen@own.test>".encode() in head
    # Nothing is left delivering, so nothing is sent again after a restart.
    left = await pool.fetchval(
        "SELECT count(*) FROM recipient WHERE status = $1", str(Status.DELIVERING)
    )
    assert left == 0
