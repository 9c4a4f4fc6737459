"""`pigeon-mta log REF`: the story of a message, from rows written through the real queue path."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.delivery_records import EVENT_FIELDS
from pigeon_mta.model import AttemptResult, Envelope, Outcome, Reply
from pigeon_mta.outbound.apply import apply_outcomes
from pigeon_mta.store.queue import enqueue
from tests.conftest import run_pigeon
from tests.integration.queue_helpers import claim, record_attempts

REPLIES = [
    (Outcome.DEFERRED, Reply(451, "4.7.1", "Greylisted, please try again later")),
    (Outcome.DEFERRED, Reply(452, "4.2.2", "Mailbox full")),
    (Outcome.DELIVERED, Reply(250, "2.0.0", "Ok: queued as 4XyZ")),
]


def story_envelope(org_id: uuid.UUID, recipients: tuple[str, ...], message_id: str) -> Envelope:
    return Envelope(
        org_id=org_id,
        sender="alice@example.com",
        recipients=recipients,
        body=f"Message-ID: <{message_id}>\r\nSubject: hi\r\n\r\nhello\r\n".encode(),
        listener="submission",
        header_message_id=message_id,
        client_ip="192.0.2.7",
        client_helo="client.example",
        auth_user="alice",
    )


async def attempt_once(
    pool: asyncpg.Pool,
    log: DeliveryLog,
    number: int,
    outcome: Outcome,
    reply: Reply,
    retry_at: datetime | None = None,
) -> None:
    """Claim the due recipients, record one outcome for all of them, log it: the engine's path."""
    deliveries = await claim(pool, owner="test-node", lease=60, batch=10)
    assert len(deliveries) == 1
    d = deliveries[0]
    results = [
        AttemptResult(
            recipient_id=r.id,
            queue_id=d.queue_id,
            org_id=d.org_id,
            attempt=r.attempts,
            outcome=outcome,
            reply=reply,
            started_at=datetime.now(UTC),
            duration=0.25,
            # due again at once, so that the next claim takes it
            next_attempt_at=(retry_at or datetime.now(UTC) - timedelta(seconds=1))
            if outcome == Outcome.DEFERRED
            else None,
            mx_host=f"mx{number}.example.net",
            ip=f"198.51.100.{10 + number}",
            port=25,
            tls_version="TLSv1.3" if number > 1 else None,
            tls_cipher="TLS_AES_256_GCM_SHA384" if number > 1 else None,
        )
        for r in d.recipients
    ]
    assert await record_attempts(pool, results) == {r.id for r in d.recipients}
    log.attempts(d, results)


async def deferred_twice_then_delivered(
    pool: asyncpg.Pool, org_id: uuid.UUID, log: DeliveryLog
) -> uuid.UUID:
    envelope = story_envelope(org_id, ("bob@example.net",), "story-1@example.com")
    queue_id = await enqueue(pool, envelope)
    log.reception(queue_id, envelope)
    for number, (outcome, reply) in enumerate(REPLIES, 1):
        await attempt_once(pool, log, number, outcome, reply)
    return queue_id


async def pigeon_log(db_url: str, *args: str) -> tuple[int, str, str]:
    result = await asyncio.to_thread(
        run_pigeon, "log", *args, env={"PIGEON_DATABASE_URL": db_url, "PIGEON_CONFIG": ""}
    )
    return result.returncode, result.stdout, result.stderr


async def test_log_shows_the_three_attempts_with_their_replies_in_order(
    pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str, tmp_path: Path
) -> None:
    log = DeliveryLog.open(str(tmp_path / "delivery.log"))
    queue_id = await deferred_twice_then_delivered(pool, org_id, log)
    log.close()

    code, out, err = await pigeon_log(db_url, str(queue_id))
    assert code == 0, err
    assert f"Message {queue_id}" in out
    assert "<story-1@example.com>" in out
    assert "alice@example.com" in out and "acme" in out
    assert "listener submission" in out and "from 192.0.2.7 (HELO client.example)" in out
    assert "authenticated as alice" in out
    timeline = [line for line in out.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert [line.split()[2] for line in timeline] == [
        "Reception",
        "TransientFailure",
        "TransientFailure",
        "Delivery",
    ]
    for line, (number, (_outcome, reply)) in zip(timeline[1:], enumerate(REPLIES, 1), strict=True):
        assert str(reply) in line
        assert f"mx{number}.example.net:25" in line and f"198.51.100.{10 + number}" in line
    assert "TLSv1.3" not in timeline[1] and "TLSv1.3" in timeline[2]
    assert re.search(r"bob@example\.net\s+delivered after 3 attempts", out)

    code, out, err = await pigeon_log(db_url, str(queue_id), "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["type"] for r in records] == [
        "Reception",
        "TransientFailure",
        "TransientFailure",
        "Delivery",
    ]
    assert [r["attempt"] for r in records] == [None, 1, 2, 3]
    assert [r["code"] for r in records] == [250, 451, 452, 250]
    assert [r["response"] for r in records[1:]] == [reply.text for _o, reply in REPLIES]
    assert [r["mx"] for r in records[1:]] == [f"mx{n}.example.net" for n in (1, 2, 3)]
    assert records[1]["tls"] is None
    assert records[3]["tls"] == {"version": "TLSv1.3", "cipher": "TLS_AES_256_GCM_SHA384"}
    for record in records:
        assert tuple(record)[: len(EVENT_FIELDS)] == EVENT_FIELDS
        assert record["queue_id"] == str(queue_id)
        assert record["message_id"] == "story-1@example.com"
        assert record["org"] == str(org_id)
        assert record["recipient"] == "bob@example.net"

    # The delivery log written as it happened says the same as the database.
    written = [json.loads(line) for line in (tmp_path / "delivery.log").read_text().splitlines()]
    assert _without_time(written) == _without_time(records)
    for mine, theirs in zip(written, records, strict=True):
        assert abs(_when(mine) - _when(theirs)) < timedelta(milliseconds=50)


def _without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "timestamp"} for r in records]


def _when(record: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))


async def test_log_finds_a_message_by_message_id_and_by_recipient_address(
    pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    log = DeliveryLog.open("")
    queue_id = await deferred_twice_then_delivered(pool, org_id, log)
    second = await enqueue(
        pool,
        story_envelope(org_id, ("bob@example.net", "carol@example.org"), "story-2@example.com"),
    )

    for ref in ("<story-1@example.com>", "story-1@example.com"):
        code, out, err = await pigeon_log(db_url, ref)
        assert code == 0, err
        assert f"Message {queue_id}" in out and str(second) not in out

    for ref in ("bob@example.net", "bob@EXAMPLE.NET"):
        code, out, err = await pigeon_log(db_url, ref)
        assert code == 0, err
        assert "2 messages found by recipient address" in out
        assert out.index(f"Message {queue_id}") < out.index(f"Message {second}")
        assert "carol" not in out  # found by address: only that recipient's story
        assert "queued, not tried yet; due now" in out

    code, out, err = await pigeon_log(db_url, "bob@example.net", "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert {r["recipient"] for r in records} == {"bob@example.net"}
    assert [r["queue_id"] for r in records if r["type"] == "Reception"] == [
        str(queue_id),
        str(second),
    ]

    code, out, err = await pigeon_log(db_url, "bob@example.net", "--limit", "1")
    assert code == 0, err
    assert f"Message {second}" in out and f"Message {queue_id}" not in out


async def test_log_shows_when_a_deferred_recipient_is_tried_next(
    pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    log = DeliveryLog.open("")
    queue_id = await enqueue(pool, story_envelope(org_id, ("dave@example.net",), "story-3@x"))
    retry_at = datetime.now(UTC) + timedelta(minutes=10)
    await attempt_once(
        pool, log, 1, Outcome.DEFERRED, Reply(421, "4.3.0", "Try later"), retry_at=retry_at
    )
    code, out, err = await pigeon_log(db_url, str(queue_id))
    assert code == 0, err
    expected = retry_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert re.search(
        rf"dave@example\.net\s+deferred after 1 attempt; next attempt {expected}\.\d+ UTC "
        rf"\(in \d+m \d+s\); last reply: 421 4\.3\.0 Try later",
        out,
    ), out
    code, out, err = await pigeon_log(db_url, str(queue_id), "--json")
    deferral = json.loads(out.splitlines()[1])
    assert deferral["type"] == "TransientFailure"
    assert _when({"timestamp": deferral["next_attempt_at"]}) == retry_at


async def test_log_says_clearly_when_nothing_matches(db_url: str) -> None:
    for ref in (str(uuid.uuid4()), "<nobody@example.org>", "nobody@example.org", "nothing"):
        code, out, err = await pigeon_log(db_url, ref)
        assert code == 1
        assert out == ""
        assert err.count("\n") == 1 and f"no message matches {ref!r}" in err


async def test_a_bounce_names_its_dsn_and_the_suppression_entry_it_made(
    pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    """Two messages bounce in one round: each Bounce event names its own DSN (queued in the same
    transaction, so at the same instant) and the address it put on the suppression list."""
    from tests.integration.test_bounces import HOST, UNKNOWN, claim_all, result

    first = await enqueue(pool, story_envelope(org_id, ("bob@example.net",), "b1@example.com"))
    second = await enqueue(pool, story_envelope(org_id, ("carol@example.org",), "b2@example.com"))
    deliveries = {d.queue_id: d for d in await claim_all(pool)}
    recorded = await apply_outcomes(
        pool,
        [
            result(deliveries[first], "bob@example.net", Outcome.BOUNCED, UNKNOWN),
            result(deliveries[second], "carol@example.org", Outcome.BOUNCED, UNKNOWN),
        ],
        hostname=HOST,
    )
    assert len(recorded.bounces) == 2
    dsn_of = {
        row["original"]: row["id"]
        for row in await pool.fetch(
            """SELECT id, substring(convert_from(body, 'UTF8')
                                    FROM 'X-Pigeon-Queue-ID: ([0-9a-f-]+)')::uuid AS original
               FROM message WHERE sender = ''"""
        )
    }

    code, out, err = await pigeon_log(db_url, str(first), "--json")
    assert code == 0, err
    [bounce] = [e for e in map(json.loads, out.splitlines()) if e["type"] == "Bounce"]
    assert bounce["dsn_queue_id"] == str(dsn_of[first]) != str(dsn_of[second])
    assert bounce["suppressed"] == "bob@example.net"

    code, out, err = await pigeon_log(db_url, str(second))
    assert code == 0, err
    [line] = [line for line in out.splitlines() if " Bounce " in line]
    assert f"DSN queued as {dsn_of[second]}" in line and "suppressed carol@example.org" in line

    # The DSN's own story says what it is, as the API and webhook events do (kind "dsn").
    code, out, err = await pigeon_log(db_url, str(dsn_of[first]), "--json")
    assert code == 0, err
    [reception] = [e for e in map(json.loads, out.splitlines()) if e["type"] == "Reception"]
    assert reception["kind"] == "dsn"
    code, out, err = await pigeon_log(db_url, str(dsn_of[first]))
    assert code == 0, err
    assert "a delivery status notification (DSN)" in out
    code, out, err = await pigeon_log(db_url, str(first), "--json")
    assert {
        e.get("kind") for e in map(json.loads, out.splitlines()) if e["type"] == "Reception"
    } == {"message"}
