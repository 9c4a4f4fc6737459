"""How each delivery was DKIM-signed, or why not, as the attempt log, `pigeon-mta log` and the
delivery log tell it; and `relay.sign_with_owner_key` for mail from trusted networks.

queue (PostgreSQL, org `internal` as a relay listener queues it) --> DeliveryEngine + DkimSigner
    --DNS--> DnsServer 127.0.0.1:<p>   --SMTP--> sinks 127.0.0.2/3:<p>
`pigeon-mta log` (the real command) reads the attempt rows back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from pigeon_mta.config import RelaySettings, Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.signer import DkimSigner
from pigeon_mta.store.orgs import ensure_org
from tests.conftest import run_pigeon
from tests.integration.dkim_helpers import add_key, add_sender_domain, delivery
from tests.integration.outbound_helpers import running_engine, send, wait_final
from tests.peers.dkim_verify import dkim_zone, dkimpy_verify
from tests.peers.world import mail_world

# From: a domain of org `acme`; the relay mail below belongs to the trusted org, `internal`.
BODY = (
    b"From: Alice <alice@order.test>\r\n"
    b"To: bob@plain.test\r\n"
    b"Subject: from a host in trusted_networks\r\n"
    b"Message-ID: <relay-1@order.test>\r\n"
    b"\r\n"
    b"Hello.\r\n"
)


async def pigeon_log(db_url: str, *args: str) -> str:
    result = await asyncio.to_thread(
        run_pigeon, "log", *args, env={"PIGEON_DATABASE_URL": db_url, "PIGEON_CONFIG": ""}
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def delivery_records(lines: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, lines.splitlines()) if r["type"] == "Delivery"]


async def deliver_relay_mail(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, relay: RelaySettings
) -> tuple[uuid.UUID, bytes, list[dict[str, Any]]]:
    """Queue BODY as relay mail, deliver it with the signer `serve` builds from `relay`; the
    message as the sink got it and the engine's delivery log records."""
    log_path = tmp_path / "delivery.log"
    delivery_log = DeliveryLog.open(str(log_path))
    async with mail_world(tmp_path) as world:
        settings: Settings = dataclasses.replace(world.settings(db_url), relay=relay)
        internal = await ensure_org(pool, settings.relay.trusted_org)
        signer = DkimSigner.from_settings(pool, settings)
        try:
            async with running_engine(
                settings, pool, db_url, sign=signer, delivery_log=delivery_log
            ):
                qid = await send(
                    pool, internal, "bob@plain.test", sender="alice@order.test", body=BODY
                )
                assert await wait_final(pool, qid) == {"bob@plain.test": "delivered"}
        finally:
            signer.close()
            delivery_log.close()
        [received] = world.sinks.received_by("bob@plain.test")
    return qid, received.data, delivery_records(log_path.read_text())


async def test_relay_mail_for_another_orgs_domain_goes_out_unsigned_and_log_says_why(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str
) -> None:
    owner = await add_sender_domain(pool, "acme", "order.test")
    await add_key(pool, owner, "s1")

    qid, data, logged = await deliver_relay_mail(tmp_path, pool, db_url, RelaySettings())

    assert b"DKIM-Signature:" not in data
    why = "unsigned: no key for order.test in org internal"
    table = await pigeon_log(db_url, str(qid))
    [delivered] = [line for line in table.splitlines() if " Delivery " in line]
    assert why in delivered
    [from_database] = delivery_records(await pigeon_log(db_url, str(qid), "--json"))
    assert from_database["dkim"] == why
    [written] = logged
    assert written["dkim"] == why


async def test_sign_with_owner_key_signs_relay_mail_with_the_owners_key(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str
) -> None:
    owner = await add_sender_domain(pool, "acme", "order.test")
    _key, record = await add_key(pool, owner, "s1")

    qid, data, logged = await deliver_relay_mail(
        tmp_path, pool, db_url, RelaySettings(sign_with_owner_key=True)
    )

    with dkim_zone({"s1._domainkey.order.test": record}) as zone:
        assert dkimpy_verify(data, zone) == [True]
    signed = "signed d=order.test s=s1"
    [from_database] = delivery_records(await pigeon_log(db_url, str(qid), "--json"))
    assert from_database["dkim"] == signed
    assert signed in await pigeon_log(db_url, str(qid))
    [written] = logged
    assert written["dkim"] == signed


async def test_sign_with_owner_key_leaves_every_other_orgs_mail_to_its_own_keys(
    pool: asyncpg.Pool,
) -> None:
    """Only the trusted org's mail borrows the owner's key: another org sending as acme's domain
    still goes out unsigned, and says whose keys it lacked."""
    owner = await add_sender_domain(pool, "acme", "order.test")
    await add_key(pool, owner, "s1")
    stranger = await ensure_org(pool, "stranger")
    signer = DkimSigner(pool, owner_key_org="internal", cache_ttl=0)
    try:
        signed = await signer(delivery(stranger, BODY))
    finally:
        signer.close()
    assert signed.body == BODY
    assert signed.dkim == "unsigned: no key for order.test in org stranger"


async def test_every_unsigned_reason_is_named(pool: asyncpg.Pool) -> None:
    domain = await add_sender_domain(pool, "acme", "order.test")
    await add_key(pool, domain, "s1")
    signer = DkimSigner(pool, cache_ttl=0)
    bodies = {
        b"To: bob@plain.test\r\n\r\nno From\r\n": "unsigned: no usable From: domain",
        b"From: a@order.test\r\nno colon here\r\n\r\nx\r\n": "unsigned: malformed header section",
    }
    try:
        for body, why in bodies.items():
            assert (await signer(delivery(domain.org_id, body))).dkim == why
    finally:
        signer.close()
