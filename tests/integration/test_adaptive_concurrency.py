"""A destination's adaptive concurrency, through the real engine and a real sink.

queue (PostgreSQL) --> DeliveryEngine --DNS--> DnsServer 127.0.0.1:<p>
                                      --SMTP-> sink (final dot answered after slow_seconds)
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import asyncpg

from pigeon_mta.config import DestinationSettings, Duration
from pigeon_mta.store.orgs import ensure_org
from tests.integration.outbound_helpers import running_engine, send, wait_until
from tests.peers.world import mail_world

MESSAGES = 120


async def deliver_slowly(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID, **delivery: object
) -> int:
    """Queue MESSAGES slow messages to one destination, deliver them all; returns the most
    transactions the sink had in flight at once."""
    async with mail_world(tmp_path) as world:
        world.sinks.slow_seconds = 0.2
        settings = world.settings(db_url, concurrency=200, **delivery)
        for n in range(MESSAGES):
            await send(pool, org_id, f"slow+{n}@plain.test")

        async def all_delivered() -> bool:
            done = await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivered'")
            return bool(done == MESSAGES)

        async with running_engine(settings, pool, db_url):
            await wait_until(all_delivered, 60, "every message delivered")
        assert sorted(world.sinks.deliveries().values()) == [1] * MESSAGES
        return world.sinks.max_in_flight


async def test_a_destinations_limit_grows_from_its_start_while_replies_are_healthy(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    most = await deliver_slowly(
        tmp_path,
        pool,
        db_url,
        org_id,
        destination_concurrency=30,
        destination_concurrency_initial=3,
        max_connections_per_host=30,
    )
    assert 3 < most <= 30, most


async def test_without_adaptive_concurrency_the_limit_stays_fixed(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    most = await deliver_slowly(
        tmp_path,
        pool,
        db_url,
        org_id,
        adaptive_concurrency=False,
        destination_concurrency=3,
        max_connections_per_host=30,
    )
    assert most == 3, most


async def test_domains_hosted_at_one_site_share_its_limit(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    # Two domains whose MX records name the same hosts (in another order) are one site: its
    # limit of 2 transactions holds for both together, not 2 each.
    async with mail_world(tmp_path) as world:
        world.dns.mx("shop.test", (10, "mx1.order.test"), (20, "mx2.order.test"))
        world.dns.mx("corp.test", (5, "mx2.order.test"), (50, "mx1.order.test"))
        world.sinks.slow_seconds = 0.3
        settings = world.settings(
            db_url,
            concurrency=200,
            destination_concurrency=2,
            adaptive_concurrency=False,
            max_connections_per_host=30,
        )
        for n in range(12):
            await send(pool, org_id, f"s{n}@shop.test")
            await send(pool, org_id, f"c{n}@corp.test")

        async def all_delivered() -> bool:
            done = await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivered'")
            return bool(done == 24)

        async with running_engine(settings, pool, db_url):
            await wait_until(all_delivered, 60, "every message delivered")
        assert sorted(world.sinks.deliveries().values()) == [1] * 24
        assert world.sinks.max_in_flight == 2


async def test_a_destination_with_only_a_rate_keeps_its_concurrency_limit(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    # The rate is a cluster budget; the sessions at once are still the per-process limit's (and
    # its adaptive feedback's), not as many as the rate lets through.
    most = await deliver_slowly(
        tmp_path,
        pool,
        db_url,
        org_id,
        adaptive_concurrency=False,
        destination_concurrency=3,
        max_connections_per_host=30,
        destination={"plain.test": DestinationSettings(rate=1000)},
    )
    assert most == 3, most


async def test_an_org_whose_mail_hangs_leaves_room_for_another_orgs_mail(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    """Org A's 30 messages get no reply to their final dot; the engine has 8 slots and one org
    may hold 3/4 of them. A holds 6 and no more, and org B's mail, queued afterwards, is
    delivered while A's still hang (with every slot A's, it would wait for them)."""
    other = await ensure_org(pool, "other")
    async with mail_world(tmp_path) as world:
        world.sinks.slow_seconds = 0
        settings = world.settings(
            db_url,
            concurrency=8,
            max_org_share=0.75,
            destination_concurrency=30,
            destination_concurrency_initial=30,
            data_timeout=Duration(60),
        )
        for n in range(30):
            await send(pool, org_id, f"held+{n}@plain.test")
        async with running_engine(settings, pool, db_url):

            async def hanging() -> bool:
                return world.sinks.in_flight >= 6

            await wait_until(hanging, 20, "org A's transactions under way")
            await asyncio.sleep(1)
            assert world.sinks.in_flight == 6, world.sinks.in_flight
            for n in range(3):
                await send(pool, other, f"user+{n}@order.test")

            async def delivered() -> bool:
                done = await pool.fetchval(
                    "SELECT count(*) FROM recipient WHERE org_id = $1 AND status = 'delivered'",
                    other,
                )
                return bool(done == 3)

            await wait_until(delivered, 20, "org B's mail delivered")
            assert world.sinks.in_flight == 6
            world.sinks.release.set()

            async def all_delivered() -> bool:
                done = await pool.fetchval(
                    "SELECT count(*) FROM recipient WHERE status = 'delivered'"
                )
                return bool(done == 33)

            await wait_until(all_delivered, 40, "every message delivered")
