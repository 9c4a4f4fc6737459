"""The outbound pipeline as one piece: queue -> engine (DKIM signer, suppression, bounces) -> sinks.

queue (PostgreSQL) --> DeliveryEngine --DNS--> DnsServer 127.0.0.1:<p>
                                      --SMTP-> sinks 127.0.0.2/3:<p>  (recipients' and senders' MX)
"""

from __future__ import annotations

import email
import email.policy
from email.message import EmailMessage
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.signer import DkimSigner
from tests.integration.dkim_helpers import add_key, add_sender_domain
from tests.integration.outbound_helpers import running_engine, send, wait_final, wait_until
from tests.peers.dkim_verify import dkim_zone, dkimpy_verify, mail_dkim_verify, opendkim_verify
from tests.peers.world import mail_world

SIGNED_BODY = (
    b"From: Alice <alice@order.test>\r\n"
    b"To: bob@plain.test\r\n"
    b"Subject: a long subject line that is folded because it goes on and on and on and on\r\n"
    b"  and on\r\n"
    b"Date: Sun, 29 Nov 2026 12:00:00 +0000\r\n"
    b"Message-ID: <pipeline-1@order.test>\r\n"
    b"MIME-Version: 1.0\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Transfer-Encoding: 8bit\r\n"
    b"\r\n"
    b"Gr\xc3\xbc\xc3\x9fe aus dem Test.\r\n"
    b"..a line that was dot-stuffed\r\n"
)


async def test_delivered_mail_carries_signatures_that_independent_verifiers_accept(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str
) -> None:
    domain = await add_sender_domain(pool, "acme", "order.test")
    _rsa, rsa_record = await add_key(pool, domain, "rsa1", "rsa")
    _ed, ed_record = await add_key(pool, domain, "ed1", "ed25519")
    signer = DkimSigner(pool)
    try:
        async with mail_world(tmp_path) as world:
            settings = world.settings(db_url)
            async with running_engine(settings, pool, db_url, sign=signer):
                qid = await send(
                    pool,
                    domain.org_id,
                    "bob@plain.test",
                    sender="alice@order.test",
                    body=SIGNED_BODY,
                )
                assert await wait_final(pool, qid) == {"bob@plain.test": "delivered"}
            received = world.sinks.received_by("bob@plain.test")
    finally:
        signer.close()
    assert len(received) == 1
    data = received[0].data
    assert data.count(b"DKIM-Signature:") == 2
    records = {"rsa1._domainkey.order.test": rsa_record, "ed1._domainkey.order.test": ed_record}
    with dkim_zone(records) as zone:
        assert dkimpy_verify(data, zone) == [True, True]
        result = opendkim_verify(data, zone)
        assert result.ok, result.output
        rsa_checks = [s for s in mail_dkim_verify(data, zone) if s.algorithm.startswith("rsa")]
        assert rsa_checks and all(s.result == "pass" for s in rsa_checks), rsa_checks
        tampered = data.replace(b"Gr\xc3\xbc\xc3\x9fe", b"Hallo")
        assert dkimpy_verify(tampered, zone) == [False, False]


async def test_hard_bounce_reaches_the_sender_and_suppresses_the_address(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: object
) -> None:
    async with mail_world(tmp_path) as world:
        settings = world.settings(db_url)
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "reject-rcpt@plain.test", sender="alice@order.test")  # type: ignore[arg-type]
            assert await wait_final(pool, qid) == {"reject-rcpt@plain.test": "bounced"}
            await world.sinks.wait_for(lambda: world.sinks.received_by("alice@order.test"))
            bounces = world.sinks.received_by("alice@order.test")
            assert len(bounces) == 1
            assert bounces[0].mail_from in ("", "<>"), "a bounce goes out with the null sender"

            report = email.message_from_bytes(bounces[0].data, policy=email.policy.default)
            assert isinstance(report, EmailMessage)
            assert report.get_content_type() == "multipart/report"
            assert report.get_param("report-type") == "delivery-status"
            status = delivery_status(report)
            assert "Status: 5.1.1" in status
            assert "Diagnostic-Code: smtp; 550" in status
            assert "Final-Recipient: rfc822; reject-rcpt@plain.test" in status

            listed = await pool.fetchval(
                "SELECT count(*) FROM suppression WHERE address = 'reject-rcpt@plain.test'"
            )
            assert listed == 1
            rcpts_before = world.sinks.rcpt_commands["reject-rcpt@plain.test"]
            again = await send(pool, org_id, "reject-rcpt@plain.test", sender="alice@order.test")  # type: ignore[arg-type]
            assert await wait_final(pool, again) == {"reject-rcpt@plain.test": "suppressed"}
            assert world.sinks.rcpt_commands["reject-rcpt@plain.test"] == rcpts_before
            # A suppressed recipient produces no second bounce.
            assert len(world.sinks.received_by("alice@order.test")) == 1


async def test_one_bounce_names_every_failed_recipient(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: object
) -> None:
    async with mail_world(tmp_path) as world:
        settings = world.settings(db_url)
        async with running_engine(settings, pool, db_url):
            qid = await send(
                pool,
                org_id,  # type: ignore[arg-type]
                "ok@plain.test",
                "reject-rcpt+1@plain.test",
                "reject-rcpt+2@plain.test",
                sender="carol@order.test",
            )
            final = await wait_final(pool, qid)
            assert sorted(final.values()) == ["bounced", "bounced", "delivered"]
            await world.sinks.wait_for(lambda: world.sinks.received_by("carol@order.test"))

            async def bounce_settled() -> bool:
                return not await pool.fetchval(
                    "SELECT count(*) FROM recipient WHERE status IN ('queued', 'delivering')"
                )

            await wait_until(bounce_settled, what="bounce delivered")
            bounces = world.sinks.received_by("carol@order.test")
    assert len(bounces) == 1
    status = delivery_status(email.message_from_bytes(bounces[0].data, policy=email.policy.default))
    assert "reject-rcpt+1@plain.test" in status and "reject-rcpt+2@plain.test" in status
    assert "ok@plain.test" not in status


async def test_no_bounce_for_mail_with_the_null_sender(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: object
) -> None:
    async with mail_world(tmp_path) as world:
        settings = world.settings(db_url)
        async with running_engine(settings, pool, db_url):
            qid = await send(pool, org_id, "reject-rcpt@plain.test", sender="")  # type: ignore[arg-type]
            assert await wait_final(pool, qid) == {"reject-rcpt@plain.test": "bounced"}
    assert await pool.fetchval("SELECT count(*) FROM message") == 1, "no bounce was queued"


def delivery_status(report: email.message.Message) -> str:
    for part in report.walk():
        if part.get_content_type() == "message/delivery-status":
            payload = part.get_payload()
            if isinstance(payload, list):
                return "\n".join(str(p) for p in payload)
            return str(payload)
    pytest.fail("no message/delivery-status part")
