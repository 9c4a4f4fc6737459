"""A tenant's reputation with the real `pigeon-mta serve`: an org whose complaints are over the
threshold is paused by the first maintenance round; its mail waits, unattempted, while another
org's is delivered; `org resume` delivers what waited.

test --history, queued mail--> PostgreSQL <-- pigeon-mta serve (maintenance, engine) --> sink
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg

from tests.e2e.relay_serve import pigeon_with, relay_serve
from tests.integration.outbound_helpers import send, wait_until
from tests.integration.test_reputation import history
from tests.peers.smtp_sink import SinkState


async def test_a_paused_org_waits_while_another_flows_and_resume_delivers(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    sink = SinkState()
    async with relay_serve(
        tmp_path,
        db_url,
        node_name="e2e-reputation",
        submission=False,
        sink=sink,
        tables={
            "delivery": {"poll_interval": "250ms", "sweep_interval": "1s"},
            "metrics": {"stats_interval": "1s"},
            "reputation": {"min_volume": 50},
        },
        setup=[("org", "add", "other")],
    ) as relay:
        acme = await pool.fetchval("SELECT id FROM org WHERE name = 'acme'")
        other = await pool.fetchval("SELECT id FROM org WHERE name = 'other'")
        # Written as a counting node would see it: under the mark's lock, so that no round of
        # serve's counts the history twice or passes over it.
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT FROM reputation_mark FOR UPDATE")
            await history(conn, acme, delivered=200, complaints=4)  # 2%
            await history(conn, other, delivered=200)
            await conn.execute("UPDATE reputation_mark SET counted_to = now() - interval '1 hour'")

        async def paused() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM suspension WHERE key = 'org:' || $1::text"
                    " AND kind = 'reputation'",
                    str(acme),
                )
            )

        await wait_until(paused, 30, "acme paused")
        held = await send(pool, acme, "ann@sink.test", sender="app@acme.example")
        flowing = await send(pool, other, "bob@sink.test", sender="app@other.example")
        await sink.wait_for(lambda: sink.deliveries().get("bob@sink.test") == 1, 30)
        await asyncio.sleep(2)  # poll rounds of the engine: acme's mail is passed by
        assert "ann@sink.test" not in sink.deliveries()
        assert await pool.fetchval("SELECT count(*) FROM attempt WHERE message_id = $1", held) == 0
        story = await pigeon_with(relay.config, "log", str(held))
        assert "org paused: complaint rate 2.00% over 24h (4 of 200" in story, story
        shown = await pigeon_with(relay.config, "org", "show", "acme")
        assert "complaint rate 2.00%" in shown, shown

        await pigeon_with(relay.config, "org", "resume", "acme")
        await sink.wait_for(lambda: sink.deliveries().get("ann@sink.test") == 1, 30)
        await asyncio.sleep(1.5)  # a maintenance round after the resume: no second pause
        assert not await paused()
        assert (
            await pool.fetchval("SELECT status FROM recipient WHERE message_id = $1", flowing)
            == "delivered"
        )
    assert relay.exit_code == 0, relay.serve.output
    assert "org acme paused: complaint rate 2.00%" in relay.serve.output
