"""Whatever a peer answers, and whoever sent the mail, the outcome is recorded: a property test.

Hypothesis draws a reply (any code, any enhanced code, any text: other scripts' digits, control
characters, lone surrogates as aiosmtplib leaves undecodable bytes, 32 KB of lines) and an
envelope sender (ASCII, SMTPUTF8, or the null sender), at any stage of the transaction. Each goes
the whole way a real result goes, on a real PostgreSQL: `judge`, the recorder's record (the
recipient's state, the attempt row, the webhook event of an org with a webhook, the DSN of a
failure, the suppression entry), and the delivery log. It must be recorded as it is: the
recorder never needs its fallbacks for it.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pigeon_mta import metrics
from pigeon_mta.config import DeliverySettings, ServerSettings, Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.model import Outcome
from pigeon_mta.outbound.attempt import Peer, RecipientResult
from pigeon_mta.outbound.claims import Claims
from pigeon_mta.outbound.classify import parse_reply
from pigeon_mta.outbound.outcome import judge
from pigeon_mta.outbound.recorder import Recorder
from pigeon_mta.store.orgs import ensure_org
from pigeon_mta.store.webhooks import EVENT_TYPES, add_webhook
from tests.integration.outbound_helpers import send
from tests.integration.queue_helpers import claim

OWNER = "node-property"
FAILED_STATUSES = {"bounced", "expired"}

digits = st.sampled_from("0123456789\u0661\u0663\u06f5\u0966\uff11\U0001d7d9")
enhanced_codes = st.one_of(
    st.builds(
        lambda k, a, b: f"{k}.{a}.{b}",
        st.sampled_from("245\u0665"),
        st.text(digits, min_size=1, max_size=3),
        st.text(digits, min_size=1, max_size=3),
    ),
    st.text(max_size=12),
)
line_text = st.text(
    st.characters(codec=None, exclude_categories=()),  # every code point, surrogates included
    max_size=300,
)
texts = st.one_of(
    line_text,
    st.builds(lambda e, t: f"{e} {t}", enhanced_codes, line_text),
    # A reply of many lines, as long as aiosmtplib reads (32 KB), full of words rules look for.
    st.builds(
        lambda word, n: "\n".join([f"5.1.1 {word * 100}"] * n),
        st.sampled_from(["exceeded ", "user unknown ", "\u0661", "\x00\x1b", "x"]),
        st.integers(1, 30),
    ),
)
codes = st.one_of(st.integers(-1, 999), st.sampled_from([250, 421, 450, 452, 550, 552, 554]))
local_chars = st.characters(
    exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp", "Cf"), exclude_characters='@<>"\\,;:()[] '
)
senders = st.one_of(
    st.just(""),
    st.builds(
        lambda local, domain: f"{local}@{domain}.test",
        st.text(local_chars, min_size=1, max_size=40),
        st.text(st.characters(categories=("Ll", "Lo", "Nd")), min_size=1, max_size=20),
    ),
)
stages = st.sampled_from(["mail", "rcpt", "data", "dot", "connect", "route"])


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(code=codes, text=texts, sender=senders, stage=stages)
# The replies and the sender that stopped a worker's recorder.
@example(code=550, text="5.\u0661.1 User unknown", sender="alice@own.test", stage="rcpt")
@example(code=550, text="5.1.1 User unknown", sender="j\u00fcrgen@own.test", stage="rcpt")
@example(code=450, text="4.\u0661.1 try later", sender="alice@own.test", stage="rcpt")
@example(code=550, text="\n".join(["5.7.1 " + "exceeded " * 110] * 30), sender="", stage="dot")
def test_any_reply_to_any_sender_is_recorded_whole(
    db_url: str, code: int, text: str, sender: str, stage: Any
) -> None:
    asyncio.run(_one_outcome(db_url, code, text, sender, stage))


async def _one_outcome(db_url: str, code: int, text: str, sender: str, stage: Any) -> None:
    pool = await asyncpg.create_pool(db_url, min_size=1, max_size=2)
    assert pool is not None
    log_path = Path(tempfile.mkdtemp(prefix="pigeon-property-")) / "delivery.log"
    try:
        org_id = await ensure_org(pool, "acme")
        if not await pool.fetchval("SELECT count(*) FROM webhook"):
            await add_webhook(pool, org_id, "https://hooks.example/p", EVENT_TYPES, "whsec_x")
        await pool.execute("UPDATE recipient SET status = 'cancelled' WHERE status = 'queued'")
        message_id = await send(pool, org_id, "someone@example.test", sender=sender)
        (delivery,) = await claim(pool, owner=OWNER, lease=300, batch=1)
        now = datetime.now(UTC)
        (recipient,) = delivery.recipients
        results = judge(
            delivery,
            [RecipientResult(recipient, stage, parse_reply(code, text))],
            peer=Peer("mx.example.test", "127.0.0.1", 25),
            duration=0.1,
            started_at=now,
            now=now,
            settings=DeliverySettings(),
            rng=random.Random(1),
        )
        claims = Claims(pool, owner=OWNER, lease=300)
        claims.hold([delivery], asyncio.get_running_loop().time())
        delivery_log = DeliveryLog.open(str(log_path))
        recorder = Recorder(
            pool, Settings(server=ServerSettings(hostname="pigeon.test")), claims, delivery_log
        )
        before = {s: _failures(s) for s in metrics.RECORD_FAILURE_STEPS}
        dsn_before = {s: _dsn_failures(s) for s in metrics.DSN_FAILURE_STEPS}
        await recorder.record(results)  # as it is: no fallback
        delivery_log.close()

        (result,) = results
        row = await pool.fetchrow(
            "SELECT status, last_response FROM recipient WHERE id = $1", recipient.id
        )
        expected = "queued" if result.outcome == Outcome.DEFERRED else str(result.outcome)
        assert row["status"] == expected
        attempt = await pool.fetchrow(
            "SELECT outcome, response, applied FROM attempt WHERE recipient_id = $1",
            recipient.id,
        )
        assert attempt["applied"] and attempt["outcome"] == str(result.outcome)
        event = await pool.fetchval(
            "SELECT payload::text FROM webhook_event WHERE payload->'data'->>'recipient_id' = $1",
            str(recipient.id),
        )
        assert json.loads(event)["data"]["response"] == row["last_response"]
        records = [json.loads(line) for line in log_path.read_text("utf-8").splitlines()]
        assert [r["recipient"] for r in records] == ["someone@example.test"]
        assert records[0]["queue_id"] == str(message_id)
        if row["status"] in FAILED_STATUSES and sender:
            dsn = await pool.fetchval(
                "SELECT m.body FROM message m JOIN recipient r ON r.message_id = m.id "
                "WHERE m.sender = '' AND r.address = $1",
                sender,
            )
            _check_dsn(bytes(dsn), sender)
        assert {s: _failures(s) for s in metrics.RECORD_FAILURE_STEPS} == before
        assert {s: _dsn_failures(s) for s in metrics.DSN_FAILURE_STEPS} == dsn_before
    finally:
        await pool.close()


def _check_dsn(body: bytes, sender: str) -> None:
    """RFC 5322 lines, a delivery-status part in US-ASCII, the sender named in To:."""
    assert max(len(line) for line in body.split(b"\r\n")) <= 998
    assert b"\n" not in body.replace(b"\r\n", b"")
    status = body.split(b"Content-Type: message/delivery-status", 1)[1].split(b"\r\n--", 1)[0]
    assert status.isascii()
    head = body.split(b"\r\n\r\n", 1)[0].decode("utf-8")
    assert f"To: <{sender}>" in head
    assert b"\r\nStatus: 5." in status or b"\r\nStatus: 4.4.7" in status


def _failures(step: str) -> float:
    return metrics.RECORD_FAILURES.labels(step=step)._value.get()  # type: ignore[attr-defined]


def _dsn_failures(step: str) -> float:
    return metrics.DSN_FAILURES.labels(step=step)._value.get()  # type: ignore[attr-defined]
