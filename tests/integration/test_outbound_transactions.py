"""Per-recipient outcomes, retries and their timing, lost connections, expiry.

engine --SMTP--> sinks (recipient local part picks the sink's behaviour, tests/peers/smtp_sink.py)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
from prometheus_client import REGISTRY

from pigeon_mta.backoff import backoff_window
from pigeon_mta.model import Delivery, Signed
from tests.integration.outbound_helpers import (
    attempts,
    running_engine,
    send,
    wait_attempts,
    wait_final,
    wait_until,
)
from tests.peers.world import World, mail_world


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with mail_world(tmp_path) as w:
        yield w


@pytest.fixture(params=[True, False], ids=["pipelining", "lockstep"])
async def either_world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    """Sinks that offer PIPELINING, and sinks that do not (each command waits for its reply)."""
    async with mail_world(tmp_path, pipelining=request.param) as w:
        yield w


async def test_mixed_recipient_outcomes_in_one_transaction_are_recorded_per_recipient(
    either_world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    world = either_world
    settings = world.settings(db_url, retry_initial=60, retry_max=60)
    recipients = (
        "ok@order.test",
        "reject-rcpt@order.test",
        "full@order.test",
        "tempfail@order.test",
    )
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, *recipients)
        rows = await wait_attempts(pool, qid, 4)
    by_address = {r["address"]: r for r in rows}
    assert {a: (r["outcome"], r["code"], r["enhanced_code"]) for a, r in by_address.items()} == {
        "ok@order.test": ("delivered", 250, "2.0.0"),
        "reject-rcpt@order.test": ("bounced", 550, "5.1.1"),
        "full@order.test": ("deferred", 552, "5.2.2"),  # 552 at RCPT is a 452
        "tempfail@order.test": ("deferred", 451, "4.7.1"),
    }
    assert outcome_rule(by_address["full@order.test"]["rule"]) == "552-at-rcpt-is-452"
    # One transaction carried them all: one connection, one message with the accepted recipient.
    assert world.sinks.connections["127.0.0.2"] == 1
    [message] = world.sinks.messages
    assert message.rcpt_tos == ["ok@order.test"]
    states = {
        r["address"]: (r["status"], r["attempts"])
        for r in await pool.fetch("SELECT * FROM recipient WHERE message_id = $1", qid)
    }
    assert states == {
        "ok@order.test": ("delivered", 1),
        "reject-rcpt@order.test": ("bounced", 1),
        "full@order.test": ("queued", 1),
        "tempfail@order.test": ("queued", 1),
    }


async def test_a_rejection_after_data_bounces_every_recipient_of_the_message(
    either_world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    world = either_world
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "reject-data@order.test", "ok@order.test")
        assert await wait_final(pool, qid) == {
            "reject-data@order.test": "bounced",
            "ok@order.test": "bounced",
        }
    rows = await attempts(pool, qid)
    assert {(r["code"], r["enhanced_code"]) for r in rows} == {(554, "5.6.0")}
    assert world.sinks.messages == []


async def test_a_temporary_failure_is_retried_inside_the_backoff_window_then_delivered_once(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, retry_initial=1, retry_max=2)
    async with running_engine(settings, pool, db_url):
        qid = await send(pool, org_id, "tempfail@order.test")
        assert await wait_final(pool, qid) == {"tempfail@order.test": "delivered"}
    first, second = await attempts(pool, qid)
    assert (first["outcome"], first["code"]) == ("deferred", 451)
    low, high = backoff_window(1, 1, 2)
    # The next try was set when the transaction ended: after it started, before it was recorded.
    assert first["started_at"] + timedelta(seconds=low) <= first["next_attempt_at"]
    assert first["next_attempt_at"] <= first["recorded_at"] + timedelta(seconds=high)
    assert second["started_at"] >= first["next_attempt_at"]
    assert (second["outcome"], second["attempt"]) == ("delivered", 2)
    assert world.sinks.deliveries()["tempfail@order.test"] == 1


async def test_a_peer_that_drops_after_the_final_dot_gets_the_mail_again_and_the_log_says_so(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "drop-after-dot@order.test")
        assert await wait_final(pool, qid) == {"drop-after-dot@order.test": "delivered"}
    first, second = await attempts(pool, qid)
    assert first["outcome"] == "deferred" and outcome_rule(first["rule"]) == "lost-after-data"
    assert "possible duplicate" in first["response"]
    assert second["outcome"] == "delivered"
    # The sink did receive it twice: the first copy is the duplicate the log warned about.
    received = world.sinks.received_by("drop-after-dot@order.test")
    assert [m.replied for m in received] == [False, True]


async def test_a_connection_cut_during_data_is_deferred_without_a_duplicate(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    body = b"Subject: big\r\n\r\n" + b"x" * 200 + b"\r\n"
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "drop-mid-data@order.test", body=body)
        assert await wait_final(pool, qid) == {"drop-mid-data@order.test": "delivered"}
    first, second = await attempts(pool, qid)
    assert first["outcome"] == "deferred" and outcome_rule(first["rule"]) in (
        "connection",
        "lost-after-data",
    )
    assert second["outcome"] == "delivered"
    assert world.sinks.deliveries()["drop-mid-data@order.test"] == 1


async def test_a_deferral_whose_next_try_would_pass_max_age_expires_instead(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    settings = world.settings(db_url, max_age=3600, retry_initial=60, retry_max=60)
    qid = await send(pool, org_id, "bob@servfail.test")
    retried = await send(pool, org_id, "carol@servfail.test")
    # Both messages were received almost max_age ago; bob has waited all that time, carol's
    # time in the queue began again just now (an operator's `queue retry` of her expiry): max_age
    # counts from the recipient's created_at, as the sweeper's expiry does.
    await pool.execute(
        "UPDATE message SET received_at = now() - interval '3590 seconds' WHERE id = ANY ($1)",
        [qid, retried],
    )
    await pool.execute(
        "UPDATE recipient SET created_at = now() - interval '3590 seconds' WHERE message_id = $1",
        qid,
    )
    async with running_engine(settings, pool, db_url):
        assert await wait_final(pool, qid) == {"bob@servfail.test": "expired"}
        for _ in range(100):
            [carol] = await attempts(pool, retried) or [None]
            if carol is not None:
                break
            await asyncio.sleep(0.05)
    [row] = await attempts(pool, qid)
    assert row["outcome"] == "expired" and row["enhanced_code"] == "4.4.3"
    assert row["next_attempt_at"] is None
    assert carol is not None and carol["outcome"] == "deferred" and carol["next_attempt_at"]


async def test_the_sign_step_decides_the_bytes_that_are_sent(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    async def sign(delivery: Delivery) -> Signed:
        return Signed(b"DKIM-Signature: v=1; test\r\n" + delivery.body, "signed d=test s=test")

    async with running_engine(world.settings(db_url), pool, db_url, sign=sign):
        qid = await send(pool, org_id, "bob@order.test")
        await wait_final(pool, qid)
    [message] = world.sinks.messages
    assert message.data.startswith(b"DKIM-Signature: v=1; test\r\nFrom: a@sender.test\r\n")


async def test_outcomes_and_timings_are_counted_in_the_metrics(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = {
        "delivered": sample("pigeon_deliveries_total", outcome="delivered"),
        "bounced": sample("pigeon_deliveries_total", outcome="bounced"),
        "attempts": sample("pigeon_delivery_attempt_seconds_count"),
        "accept": sample("pigeon_accept_to_delivery_seconds_count"),
    }
    async with running_engine(world.settings(db_url), pool, db_url):
        # The null sender: the bounce would otherwise be a second (counted) delivery.
        qid = await send(pool, org_id, "ok@order.test", "reject-rcpt@order.test", sender="")
        await wait_final(pool, qid)
    assert sample("pigeon_deliveries_total", outcome="delivered") - before["delivered"] == 1
    assert sample("pigeon_deliveries_total", outcome="bounced") - before["bounced"] == 1
    assert sample("pigeon_delivery_attempt_seconds_count") - before["attempts"] == 1
    assert sample("pigeon_accept_to_delivery_seconds_count") - before["accept"] == 1


async def test_a_transaction_longer_than_the_lease_keeps_its_claim(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    world.sinks.slow_seconds = 4
    async with running_engine(world.settings(db_url, lease=5), pool, db_url):
        qid = await send(pool, org_id, "slow@order.test")

        async def claimed() -> bool:
            row = await pool.fetchrow("SELECT * FROM recipient WHERE message_id = $1", qid)
            return row["status"] == "delivering"

        await wait_until(claimed, 30, "the claim")
        first = await pool.fetchval("SELECT lease_until FROM recipient WHERE message_id = $1", qid)

        async def renewed() -> bool:
            lease = await pool.fetchval(
                "SELECT lease_until FROM recipient WHERE message_id = $1 AND status = 'delivering'",
                qid,
            )
            return lease is not None and lease > first

        await wait_until(renewed, 30, "a renewed lease")
        assert await wait_final(pool, qid) == {"slow@order.test": "delivered"}
    [row] = await attempts(pool, qid)
    assert row["applied"]


def outcome_rule(rule: str) -> str:
    """The engine's outcome rule; the bounce-classification rule follows after "; "."""
    return rule.split("; ")[0]


async def test_the_engine_says_what_it_takes_and_keeps_count_until_its_next_claim(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """Listeners ask `takes` before they NOTIFY the other processes: yes while the room left
    after what it was promised since its last claim holds it, and no once it stops."""
    settings = world.settings(db_url)
    room = settings.delivery.concurrency
    async with running_engine(settings, pool, db_url) as engine:
        await asyncio.sleep(0.3)  # started and idle
        assert engine.takes(room) is True
        assert engine.takes(1) is False, "everything was promised"
        qid = await send(pool, org_id, "ok@order.test")
        engine.waker.wake()  # type: ignore[union-attr]
        assert await wait_final(pool, qid) == {"ok@order.test": "delivered"}
        assert engine.takes(1) is True, "a claim since: the promise is spent"
    assert engine.takes(1) is False, "a stopped engine takes nothing"


async def test_an_unreadable_suppression_list_stops_the_claim(
    world: World, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """Without the suppression list nobody can tell who must not be mailed: the claim, which
    reads it, fails (no attempt counted, nothing sent) until the list can be read, then the mail
    goes."""
    await pool.execute("ALTER TABLE suppression RENAME TO suppression_away")
    async with running_engine(world.settings(db_url), pool, db_url):
        qid = await send(pool, org_id, "ok@order.test")
        await asyncio.sleep(1.0)  # several claims tried and failed (poll 0.1 s)
        assert world.sinks.messages == []
        assert await pool.fetchval("SELECT count(*) FROM attempt") == 0
        assert await pool.fetchval("SELECT max(attempts) FROM recipient") == 0
        await pool.execute("ALTER TABLE suppression_away RENAME TO suppression")
        assert await wait_final(pool, qid) == {"ok@order.test": "delivered"}
    [row] = await attempts(pool, qid)
    assert (row["outcome"], row["attempt"]) == ("delivered", 1)
