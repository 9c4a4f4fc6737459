"""Routing with real DNS on loopback: MX order and fallback, implicit MX, null MX, NXDOMAIN, SERVFAIL.

engine --DNS--> DnsServer --> zones of tests/peers/world.py
       --SMTP-> sinks on 127.0.0.2..7
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.integration.outbound_helpers import attempts, running_engine, send, wait_final
from tests.peers.world import World, mail_world


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with mail_world(tmp_path) as w:
        yield w


async def test_mail_goes_to_the_most_preferred_mx(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@order.test")
        assert await wait_final(pool, qid) == {"bob@order.test": "delivered"}
    [message] = world.sinks.received_by("bob@order.test")
    assert message.sink == "127.0.0.2"
    [row] = await attempts(pool, qid)
    assert (row["mx_host"], row["ip"], row["port"]) == ("mx1.order.test", "127.0.0.2", world.port)
    assert row["outcome"] == "delivered" and row["code"] == 250


async def test_second_mx_takes_the_mail_when_the_first_refuses_connections(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@fallback.test")
        assert await wait_final(pool, qid) == {"bob@fallback.test": "delivered"}
    assert [m.sink for m in world.sinks.received_by("bob@fallback.test")] == ["127.0.0.3"]
    [row] = await attempts(pool, qid)
    assert row["mx_host"] == "live.fallback.test"


async def test_a_4xx_greeting_moves_on_to_the_next_mx(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@busy.test")
        assert await wait_final(pool, qid) == {"bob@busy.test": "delivered"}
    assert world.sinks.connections["127.0.0.4"] >= 1
    assert [m.sink for m in world.sinks.received_by("bob@busy.test")] == ["127.0.0.2"]


async def test_a_domain_without_mx_gets_mail_at_its_address(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@implicit.test")
        assert await wait_final(pool, qid) == {"bob@implicit.test": "delivered"}
    [row] = await attempts(pool, qid)
    assert (row["mx_host"], row["ip"]) == ("implicit.test", "127.0.0.3")


async def test_an_internationalized_domain_is_looked_up_in_idna_form(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@bücher.test")
        assert await wait_final(pool, qid) == {"bob@bücher.test": "delivered"}
    [message] = world.sinks.messages
    assert message.rcpt_tos == ["bob@xn--bcher-kva.test"]  # no SMTPUTF8 needed for a domain
    assert world.dns.asked("xn--bcher-kva.test", "MX") == 1


@pytest.mark.parametrize(
    ("address", "status", "enhanced", "text"),
    [
        ("bob@nullmx.test", "bounced", "5.1.10", "null MX"),
        ("bob@nowhere.test", "bounced", "5.1.2", "NXDOMAIN"),
        ("bob@servfail.test", "queued", "4.4.3", "SERVFAIL"),
    ],
)
async def test_dns_answers_that_stop_delivery(
    world: World,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    db_url: str,
    address: str,
    status: str,
    enhanced: str,
    text: str,
) -> None:
    async with running_engine(world.settings(db_url, retry_initial=60, retry_max=60), pool, db_url):
        qid = await send(pool, org_id, address)
        from tests.integration.outbound_helpers import wait_attempts

        [row] = await wait_attempts(pool, qid, 1)
    state = await pool.fetchrow("SELECT * FROM recipient WHERE message_id = $1", qid)
    assert state["status"] == status
    assert row["enhanced_code"] == enhanced and text in row["response"]
    assert row["outcome"] == ("bounced" if status == "bounced" else "deferred")
    assert world.sinks.messages == []


async def test_an_address_literal_is_delivered_to_that_address_without_dns(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@[127.0.0.3]")
        assert await wait_final(pool, qid) == {"bob@[127.0.0.3]": "delivered"}
    assert [m.sink for m in world.sinks.messages] == ["127.0.0.3"]
    assert sum(world.dns.queries.values()) == 0
