"""Failures inside pigeon-mta at delivery: a message that one stage cannot process is not retried
until delivery.max_age, and a From: the signer cannot read no longer fails the delivery at all.

queue (PostgreSQL) --> DeliveryEngine (sign step) --DNS--> DnsServer 127.0.0.1:<p>
                                                  --SMTP-> sinks 127.0.0.2/3:<p>
"""

from __future__ import annotations

import email
import email.policy
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.model import Delivery, Signed
from pigeon_mta.outbound.outcome import LOCAL_FAILURE_LIMIT
from pigeon_mta.signer import DkimSigner
from tests.integration.dkim_helpers import add_key, add_sender_domain
from tests.integration.outbound_helpers import BODY, attempts, running_engine, send, wait_final
from tests.peers.world import mail_world

POISON = b"X-Test: the sign step cannot process this message\r\n" + BODY


async def sign_with_a_bug(delivery: Delivery) -> Signed:
    """A sign step that fails the same way on every attempt for one message, as the DKIM
    signer's From: parser did on nested comments (RecursionError): a bug, not a passing fault."""
    if delivery.body.startswith(b"X-Test: the sign step cannot"):
        raise ValueError("cannot process this message")
    return Signed(delivery.body)


async def test_a_local_failure_that_recurs_on_every_attempt_bounces(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: object
) -> None:
    async with mail_world(tmp_path) as world:
        settings = world.settings(db_url)
        async with running_engine(settings, pool, db_url, sign=sign_with_a_bug):
            poison = await send(
                pool, org_id, "bob@plain.test", sender="alice@order.test", body=POISON
            )  # type: ignore[arg-type]
            fine = await send(pool, org_id, "carol@plain.test", sender="alice@order.test")  # type: ignore[arg-type]
            assert await wait_final(pool, fine) == {"carol@plain.test": "delivered"}
            assert await wait_final(pool, poison) == {"bob@plain.test": "bounced"}
            await world.sinks.wait_for(lambda: world.sinks.received_by("alice@order.test"))
        tried = await attempts(pool, poison)
    assert [a["outcome"] for a in tried] == ["deferred"] * (LOCAL_FAILURE_LIMIT - 1) + ["bounced"]
    assert [a["enhanced_code"] for a in tried] == ["4.3.0"] * (LOCAL_FAILURE_LIMIT - 1) + ["5.3.0"]
    assert tried[0]["response"] == "ValueError: cannot process this message"
    assert tried[-1]["response"] == (
        "ValueError: cannot process this message "
        f"(the same local failure on {LOCAL_FAILURE_LIMIT} attempts in a row; given up)"
    )
    assert world.sinks.received_by("bob@plain.test") == []
    # The sender learns why; the recipient is not put on the suppression list for our failure.
    (bounce,) = world.sinks.received_by("alice@order.test")
    report = email.message_from_bytes(bounce.data, policy=email.policy.default)
    assert "Status: 5.3.0" in report.as_string()
    assert await pool.fetchval("SELECT count(*) FROM suppression") == 0


@pytest.mark.parametrize(
    "from_value",
    [
        b"(" * 20_000 + b")" * 20_000 + b" alice@order.test",
        b", ".join(b"u%d@order.test" % i for i in range(50_000)),
    ],
    ids=["nested-comments", "50000-addresses"],
)
async def test_a_from_the_signer_cannot_read_goes_out_unsigned_at_once(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, from_value: bytes
) -> None:
    """Queued as a trusted client's message may be (reception does not parse its From:), it is
    delivered unsigned on the first attempt instead of being deferred until max_age."""
    domain = await add_sender_domain(pool, "acme", "order.test")
    await add_key(pool, domain, "s1")
    # Folded into lines of 100 octets, as reception does with longer lines (RFC 5322 2.1.1).
    folded = b"\r\n ".join(from_value[i : i + 100] for i in range(0, len(from_value), 100))
    body = b"From: " + folded + b"\r\nTo: bob@plain.test\r\nSubject: s\r\n\r\nHello.\r\n"
    signer = DkimSigner(pool)
    try:
        async with mail_world(tmp_path) as world:
            settings = world.settings(db_url)
            async with running_engine(settings, pool, db_url, sign=signer):
                qid = await send(pool, domain.org_id, "bob@plain.test", body=body)
                assert await wait_final(pool, qid) == {"bob@plain.test": "delivered"}
            (received,) = world.sinks.received_by("bob@plain.test")
    finally:
        signer.close()
    assert b"DKIM-Signature:" not in received.data
    assert [a["outcome"] for a in await attempts(pool, qid)] == ["delivered"]
