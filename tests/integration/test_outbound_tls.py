"""TLS policy per destination, the relayhost with AUTH, static routes.

engine --STARTTLS--> 127.0.0.5 (certificate for mx.tls.test, from a trustme CA)
       --STARTTLS--> 127.0.0.6 (answers "220 Ready" and then breaks the handshake)
       --SMTP-----> 127.0.0.2 (no STARTTLS)
       --STARTTLS + AUTH--> 127.0.0.7 relay.test (smarthost)
"""

from __future__ import annotations

import asyncio
import ssl
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.config import DestinationSettings, Settings, TlsPolicy
from tests.integration.outbound_helpers import (
    attempts,
    running_engine,
    send,
    wait_attempts,
    wait_final,
)
from tests.peers.smtp_sink import start_sink, stop_servers
from tests.peers.world import RELAY_USER, World, mail_world


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with mail_world(tmp_path) as w:
        yield w


async def test_opportunistic_tls_is_used_when_offered_and_recorded(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@tls.test")
        assert await wait_final(pool, qid) == {"bob@tls.test": "delivered"}
    [row] = await attempts(pool, qid)
    assert row["tls_version"] in ("TLSv1.2", "TLSv1.3") and row["tls_cipher"]
    [message] = world.sinks.messages
    assert message.tls


async def test_verify_accepts_a_certificate_for_the_mx_name(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, tls="verify")
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "bob@tls.test")
        assert await wait_final(pool, qid) == {"bob@tls.test": "delivered"}
    assert world.sinks.messages[0].tls


async def test_verify_refuses_a_certificate_for_another_name_and_never_sends_in_plaintext(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(
        db_url,
        retry_initial=60,
        retry_max=60,
        destination={"wrongname.test": DestinationSettings(tls="verify")},
    )
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "bob@wrongname.test")
        [row] = await wait_attempts(pool, qid, 1)
    assert row["outcome"] == "deferred" and row["rule"].split("; ")[0] == "tls-failed"
    assert "certificate" in row["response"].lower()
    assert world.sinks.messages == []
    assert world.sinks.connections["127.0.0.5"] == 1  # no second, plaintext connection


async def test_a_broken_handshake_under_opportunistic_tls_retries_on_a_new_plaintext_connection(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "bob@badtls.test")
        assert await wait_final(pool, qid) == {"bob@badtls.test": "delivered"}
    [row] = await attempts(pool, qid)
    assert row["tls_version"] is None
    [message] = world.sinks.messages
    assert not message.tls
    assert world.sinks.connections["127.0.0.6"] == 2


@pytest.mark.parametrize("domain", ["badtls.test", "plain.test"])
async def test_required_tls_defers_when_tls_fails_or_is_not_offered(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str, domain: str
) -> None:
    settings = world.settings(db_url, tls="required", retry_initial=60, retry_max=60)
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, f"bob@{domain}")
        [row] = await wait_attempts(pool, qid, 1)
    assert row["outcome"] == "deferred"
    assert world.sinks.messages == []


async def test_policy_none_never_starts_tls(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, destination={"tls.test": DestinationSettings(tls="none")})
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "bob@tls.test")
        assert await wait_final(pool, qid) == {"bob@tls.test": "delivered"}
    assert not world.sinks.messages[0].tls


async def test_relayhost_with_auth_over_verified_tls_carries_every_domain(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(
        db_url,
        relayhost=f"relay.test:{world.port}",
        relayhost_username=RELAY_USER[0],
        relayhost_password=RELAY_USER[1],
        relayhost_tls="verify",
    )
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "a@one.example", "b@two.example", "c@nowhere.test")
        assert set((await wait_final(pool, qid)).values()) == {"delivered"}
    # One transaction for the message: the relayhost is one destination whatever the domains.
    [message] = world.sinks.messages
    assert sorted(message.rcpt_tos) == ["a@one.example", "b@two.example", "c@nowhere.test"]
    assert message.tls and message.auth_user == RELAY_USER[0]
    assert world.dns.asked("one.example", "MX") == 0


async def test_a_relayhost_refusing_our_password_defers_the_mail(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(
        db_url,
        relayhost=f"relay.test:{world.port}",
        relayhost_username=RELAY_USER[0],
        relayhost_password="wrong",
        relayhost_tls="required",
        retry_initial=60,
        retry_max=60,
    )
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "a@one.example")
        [row] = await wait_attempts(pool, qid, 1)
    assert (row["outcome"], row["rule"].split("; ")[0], row["code"]) == (
        "deferred",
        "auth-failed",
        535,
    )
    assert world.sinks.messages == []


async def test_a_static_route_overrides_dns(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, routes={"corp.example": f"127.0.0.3:{world.port}"})
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "bob@corp.example")
        assert await wait_final(pool, qid) == {"bob@corp.example": "delivered"}
    assert world.sinks.messages[0].sink == "127.0.0.3"
    assert world.dns.asked("corp.example", "MX") == 0


async def start_mitm_relay(world: World) -> asyncio.Server:
    """A man in the middle answering for mitm-relay.test with a certificate for another name
    (from the CA the engine trusts); it offers AUTH and notes every password it is sent."""
    world.dns.a("mitm-relay.test", "127.0.0.8")
    return await start_sink(
        world.sinks,
        "127.0.0.8",
        world.port,
        tls_context=world.ca.server_context("someone-else.test"),
        users=dict([RELAY_USER]),
    )


def relayhost_settings(world: World, db_url: str, tls: TlsPolicy) -> Settings:
    return world.settings(
        db_url,
        relayhost=f"mitm-relay.test:{world.port}",
        relayhost_username=RELAY_USER[0],
        relayhost_password=RELAY_USER[1],
        relayhost_tls=tls,
        relayhost_auth_insecure=tls != "verify",
        retry_initial=60,
        retry_max=60,
    )


async def test_a_relayhost_with_another_names_certificate_never_gets_the_password(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    mitm = await start_mitm_relay(world)
    try:
        async with running_engine(relayhost_settings(world, db_url, "verify"), pool, db_url):
            qid = await send(pool, org_id, "a@one.example")
            [row] = await wait_attempts(pool, qid, 1)
    finally:
        await stop_servers([mitm])
    assert (row["outcome"], row["rule"].split("; ")[0]) == ("deferred", "tls-failed")
    assert world.sinks.connections["127.0.0.8"] == 1
    assert world.sinks.messages == []
    assert world.sinks.auth_attempts == []


async def test_the_insecure_opt_out_hands_the_password_to_whoever_answers(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """What `relayhost_auth_insecure = true` means (and why config refuses `required` without
    it): the man in the middle gets the credentials and the mail."""
    mitm = await start_mitm_relay(world)
    try:
        async with running_engine(relayhost_settings(world, db_url, "required"), pool, db_url):
            qid = await send(pool, org_id, "a@one.example")
            assert await wait_final(pool, qid) == {"a@one.example": "delivered"}
    finally:
        await stop_servers([mitm])
    assert world.sinks.auth_attempts == [("127.0.0.8", *RELAY_USER)]


LEGACY_TLS = [
    pytest.param(ssl.TLSVersion.TLSv1, "TLSv1", id="TLS 1.0"),
    pytest.param(ssl.TLSVersion.TLSv1_1, "TLSv1.1", id="TLS 1.1"),
]


async def start_legacy_mx(world: World, version: ssl.TLSVersion) -> asyncio.Server:
    """mx.oldtls.test: STARTTLS with only TLS 1.0 or 1.1, as old servers still answer."""
    world.dns.mx("oldtls.test", (10, "mx.oldtls.test"))
    world.dns.a("mx.oldtls.test", "127.0.0.10")
    return await start_sink(
        world.sinks,
        "127.0.0.10",
        world.port,
        tls_context=world.ca.legacy_server_context(version, "mx.oldtls.test"),
    )


@pytest.mark.parametrize(("version", "name"), LEGACY_TLS)
async def test_opportunistic_tls_speaks_tls_1_0_and_1_1_rather_than_plaintext(
    world: World,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    db_url: str,
    version: ssl.TLSVersion,
    name: str,
) -> None:
    mx = await start_legacy_mx(world, version)
    try:
        async with running_engine(world.settings(db_url), pool, db_url):
            qid = await send(pool, org_id, "bob@oldtls.test")
            assert await wait_final(pool, qid) == {"bob@oldtls.test": "delivered"}
    finally:
        await stop_servers([mx])
    [row] = await attempts(pool, qid)
    assert row["tls_version"] == name and row["tls_cipher"]
    [message] = world.sinks.messages
    assert message.tls
    assert world.sinks.connections["127.0.0.10"] == 1  # no plaintext retry


@pytest.mark.parametrize("policy", ["required", "verify"])
@pytest.mark.parametrize(("version", "name"), LEGACY_TLS)
async def test_required_and_verify_keep_tls_1_2_as_their_minimum(
    world: World,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    db_url: str,
    version: ssl.TLSVersion,
    name: str,
    policy: TlsPolicy,
) -> None:
    mx = await start_legacy_mx(world, version)
    settings = world.settings(db_url, tls=policy, retry_initial=60, retry_max=60)
    try:
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "bob@oldtls.test")
            [row] = await wait_attempts(pool, qid, 1)
    finally:
        await stop_servers([mx])
    # The server ends the handshake (it cannot agree on a version): deferred, never plaintext.
    assert row["outcome"] == "deferred", row["response"]
    assert world.sinks.messages == []
    assert world.sinks.connections["127.0.0.10"] == 1
