"""DSNs and suppression through the real store: recorded in the same transaction, read back as mail."""

from __future__ import annotations

import asyncio
import dataclasses
import email
import email.message
import email.policy
import email.utils
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from pigeon_mta import dsn_queue
from pigeon_mta.model import DSN_LISTENER, AttemptResult, Delivery, Envelope, Outcome, Reply
from pigeon_mta.outbound import apply, outcome
from pigeon_mta.outbound.classify import classify_reply
from pigeon_mta.store import admin_queue, queue, suppression, upkeep
from pigeon_mta.store import dsn as store_dsn
from tests.integration.queue_helpers import bulk_queue, claim, record_attempts, suppressed_at_claim
from tests.integration.test_queue import _recipient_scans

HOST = "mta.example.org"
OWNER = "node-a"
BODY = b"From: alice@example.com\r\nSubject: hello\r\nMessage-ID: <m1@example.com>\r\n\r\nhi\r\n"


async def send(
    pool: asyncpg.Pool, org_id: uuid.UUID, *recipients: str, sender: str = "alice@example.com"
) -> uuid.UUID:
    return await queue.enqueue(
        pool,
        Envelope(
            org_id=org_id,
            sender=sender,
            recipients=recipients,
            body=BODY,
            listener="relay",
            header_message_id="m1@example.com",
        ),
    )


async def claim_all(pool: asyncpg.Pool) -> list[Delivery]:
    return await claim(pool, owner=OWNER, lease=60, batch=1000)


def result(
    delivery: Delivery, address: str, outcome: Outcome, reply: Reply, *, attempt: int | None = None
) -> AttemptResult:
    (r,) = [r for r in delivery.recipients if r.address == address]
    category, rule = classify_reply(reply)
    return AttemptResult(
        recipient_id=r.id,
        queue_id=delivery.queue_id,
        org_id=delivery.org_id,
        attempt=r.attempts if attempt is None else attempt,
        outcome=outcome,
        reply=reply,
        started_at=datetime.now(UTC),
        mx_host="mx.example.net",
        ip="192.0.2.25",
        port=25,
        category=category,
        rule=rule,
    )


async def queued_dsns(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch(
        """SELECT m.id, m.sender, m.body, m.org_id, array_agg(r.address) AS rcpts
           FROM message m JOIN recipient r ON r.message_id = m.id
           WHERE m.sender = '' AND m.listener = $1 GROUP BY m.id ORDER BY m.received_at""",
        DSN_LISTENER,
    )


def delivery_status(body: bytes) -> list[email.message.Message]:
    msg = email.message_from_bytes(body, policy=email.policy.default)
    assert msg.get_content_type() == "multipart/report"
    (part,) = [p for p in msg.walk() if p.get_content_type() == "message/delivery-status"]
    blocks = part.get_payload()
    assert isinstance(blocks, list)
    return blocks


UNKNOWN = Reply(550, "5.1.1", "<bob@example.net>: Recipient address rejected: User unknown")
NO_DOMAIN = Reply(0, "5.1.10", "nowhere.example publishes a null MX")


async def test_two_permanent_failures_of_three_recipients_make_one_bounce_naming_both(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    qid = await send(pool, org_id, "bob@example.net", "carol@example.net", "dave@nowhere.example")
    deliveries = await claim_all(pool)
    by_domain = {d.domain: d for d in deliveries}
    net, nowhere = by_domain["example.net"], by_domain["nowhere.example"]
    results = [
        result(net, "bob@example.net", Outcome.BOUNCED, UNKNOWN),
        result(net, "carol@example.net", Outcome.DELIVERED, Reply(250, "2.0.0", "ok")),
        result(nowhere, "dave@nowhere.example", Outcome.BOUNCED, NO_DOMAIN),
    ]
    recorded = await apply.apply_outcomes(pool, results, hostname=HOST)

    assert len(recorded.applied) == 3 and len(recorded.bounces) == 1
    (dsn,) = await queued_dsns(pool)
    assert dsn["id"] == recorded.bounces[0]
    assert dsn["rcpts"] == ["alice@example.com"] and dsn["org_id"] == org_id
    per_message, *failed = delivery_status(bytes(dsn["body"]))
    assert per_message["X-Pigeon-Queue-ID"] == str(qid)
    assert [(b["Final-Recipient"], b["Status"], b["Action"]) for b in failed] == [
        ("rfc822; bob@example.net", "5.1.1", "failed"),
        ("rfc822; dave@nowhere.example", "5.1.10", "failed"),
    ]
    assert failed[0]["Diagnostic-Code"] == f"smtp; {UNKNOWN}"
    assert failed[0]["Remote-MTA"] == "dns; mx.example.net"
    # The DSN is ordinary queued mail: due now, from the null sender.
    rows = await pool.fetch(
        "SELECT address, status FROM recipient WHERE message_id = $1 ORDER BY address", dsn["id"]
    )
    assert [(r["address"], r["status"]) for r in rows] == [("alice@example.com", "queued")]

    # Both hard bounces are suppressed, each pointing at the attempt that caused it.
    entries = {e.address: e for e in await suppression.list_suppressions(pool, org_id)}
    assert set(entries) == {"bob@example.net", "dave@nowhere.example"}
    assert recorded.suppressed == 2
    bob = entries["bob@example.net"]
    assert bob.source == "bounce" and bob.reason.startswith("invalid-recipient: 550 5.1.1")
    attempt = await pool.fetchrow(
        "SELECT recipient_id, category FROM attempt WHERE id = $1", bob.attempt_id
    )
    assert attempt["recipient_id"] == results[0].recipient_id
    assert attempt["category"] == "invalid-recipient"


async def test_null_sender_mail_is_never_bounced(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await send(pool, org_id, "bob@example.net", sender="")
    (delivery,) = await claim_all(pool)
    recorded = await apply.apply_outcomes(
        pool, [result(delivery, "bob@example.net", Outcome.BOUNCED, UNKNOWN)], hostname=HOST
    )
    assert recorded.bounces == []
    assert await pool.fetchval("SELECT count(*) FROM message") == 1


async def test_a_bounce_that_bounces_ends_there(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await send(pool, org_id, "bob@example.net")
    (delivery,) = await claim_all(pool)
    await apply.apply_outcomes(
        pool, [result(delivery, "bob@example.net", Outcome.BOUNCED, UNKNOWN)], hostname=HOST
    )
    # The DSN to alice fails permanently too: nothing more is queued, no loop.
    (dsn_delivery,) = await claim_all(pool)
    assert dsn_delivery.sender == ""
    recorded = await apply.apply_outcomes(
        pool,
        [result(dsn_delivery, "alice@example.com", Outcome.BOUNCED, UNKNOWN)],
        hostname=HOST,
    )
    assert recorded.bounces == []
    assert await pool.fetchval("SELECT count(*) FROM message") == 2


async def test_a_stale_claim_reports_nothing(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await send(pool, org_id, "bob@example.net")
    (delivery,) = await claim_all(pool)
    stale = result(delivery, "bob@example.net", Outcome.BOUNCED, UNKNOWN, attempt=99)
    recorded = await apply.apply_outcomes(pool, [stale], hostname=HOST)
    assert recorded.applied == set() and recorded.bounces == [] and recorded.suppressed == 0
    assert await queued_dsns(pool) == []


async def test_soft_categories_bounce_but_do_not_suppress(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await send(pool, org_id, "bob@example.net")
    (delivery,) = await claim_all(pool)
    full = Reply(552, "5.2.2", "mailbox full")
    recorded = await apply.apply_outcomes(
        pool, [result(delivery, "bob@example.net", Outcome.BOUNCED, full)], hostname=HOST
    )
    assert len(recorded.bounces) == 1 and recorded.suppressed == 0
    assert await suppression.list_suppressions(pool, org_id) == []


async def test_a_manual_entry_is_not_overwritten_by_a_bounce(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await suppression.add_suppression(pool, org_id, "bob@example.net", reason="asked us to stop")
    await suppression.add_suppression(
        pool,
        org_id,
        "carol@example.net",
        reason="old",
        expires_at=datetime.now(UTC) - timedelta(days=1),
    )
    # Suppression is checked before attempting; here the engine is bypassed on purpose to see
    # what a bounce does to existing entries.
    await send(pool, org_id, "bob@example.net", "carol@example.net")
    (delivery,) = await claim_all(pool)
    await apply.apply_outcomes(
        pool,
        [
            result(delivery, "bob@example.net", Outcome.BOUNCED, UNKNOWN),
            result(delivery, "carol@example.net", Outcome.BOUNCED, UNKNOWN),
        ],
        hostname=HOST,
        suppress_for=3600,
    )
    entries = {e.address: e for e in await suppression.list_suppressions(pool, org_id)}
    assert (entries["bob@example.net"].source, entries["bob@example.net"].reason) == (
        "manual",
        "asked us to stop",
    )
    carol = entries["carol@example.net"]
    assert carol.source == "bounce" and carol.expires_at is not None
    assert carol.expires_at > datetime.now(UTC) + timedelta(minutes=50)


async def test_expiry_queues_a_4_4_7_bounce_in_the_same_transaction(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    six_days = 6 * 86400
    await bulk_queue(pool, org_id, messages=2, recipients_per_message=3, age=six_days, due_in=-60)
    await bulk_queue(pool, org_id, messages=1, recipients_per_message=2, age=six_days, due_in=-60)
    await bulk_queue(pool, org_id, messages=3, age=60, due_in=-60)  # young: stays
    # The third old message is itself a DSN: its recipients expire without a bounce.
    await pool.execute(
        """UPDATE message SET sender = '' WHERE id = (
               SELECT message_id FROM recipient GROUP BY message_id HAVING count(*) = 2)"""
    )
    await pool.execute(
        """UPDATE recipient SET attempts = 4, last_code = 451, last_enhanced_code = '4.7.1',
                  last_response = 'greylisted, come back later'
           WHERE created_at < now() - interval '1 day'"""
    )

    expired = await dsn_queue.expire_and_bounce(
        pool, max_age=5 * 86400, max_age_text="5d", hostname=HOST
    )

    assert len(expired.recipients) == 8 and len(expired.bounces) == 2
    dsns = await queued_dsns(pool)
    assert sorted(d["id"] for d in dsns) == sorted(expired.bounces)
    for dsn in dsns:
        assert dsn["rcpts"] == ["sender@example.com"]
        _, *failed = delivery_status(bytes(dsn["body"]))
        assert len(failed) == 3
        for block in failed:
            assert (block["Action"], block["Status"]) == ("failed", "4.4.7")
            assert block["Diagnostic-Code"] == "smtp; 451 4.7.1 greylisted, come back later"
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'expired'") == 8
    again = await dsn_queue.expire_and_bounce(
        pool, max_age=5 * 86400, max_age_text="5d", hostname=HOST
    )
    assert again.recipients == [] and again.bounces == []


async def test_expiry_is_undone_when_its_bounce_cannot_be_queued(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=1, recipients_per_message=2, age=6 * 86400)
    await pool.execute(
        """CREATE FUNCTION refuse_dsn() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN IF NEW.sender = '' THEN RAISE EXCEPTION 'disk full'; END IF; RETURN NEW; END $$;
           CREATE TRIGGER refuse_dsn BEFORE INSERT ON message
           FOR EACH ROW EXECUTE FUNCTION refuse_dsn();"""
    )
    with pytest.raises(asyncpg.RaiseError):
        await dsn_queue.expire_and_bounce(pool, max_age=5 * 86400, max_age_text="5d", hostname=HOST)
    # Nothing is lost: the recipients are still queued and will expire (with a DSN) next time.
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'queued'") == 2
    assert await pool.fetchval("SELECT count(*) FROM attempt") == 0


async def test_suppressed_recipients_are_not_attempted(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    from pigeon_mta.store.orgs import ensure_org

    other_org = await ensure_org(pool, "other")
    await suppression.add_suppression(pool, org_id, "Bob@Example.NET", reason="by hand")
    await suppression.add_suppression(pool, other_org, "carol@example.net", reason="other org")
    await send(pool, org_id, "BOB@example.net", "carol@example.net")
    await send(pool, org_id, "bob@example.net")

    await suppression.add_suppression(
        pool,
        org_id,
        "carol@example.net",
        reason="gone",
        expires_at=datetime.now(UTC) - timedelta(1),
    )
    keep, results = outcome.split_suppressed(await claim_all(pool), now=datetime.now(UTC))

    assert [[r.address for r in d.recipients] for d in keep] == [["carol@example.net"]]
    assert sorted(r.outcome for r in results) == ["suppressed", "suppressed"]
    assert all(r.category == "suppressed" and "suppression list" in r.reply.text for r in results)
    recorded = await apply.apply_outcomes(pool, results, hostname=HOST)
    assert len(recorded.applied) == 2 and recorded.bounces == []
    statuses = await pool.fetch("SELECT address, status FROM recipient ORDER BY address")
    assert [(r["address"], r["status"]) for r in statuses] == [
        ("BOB@example.net", "suppressed"),
        ("bob@example.net", "suppressed"),
        ("carol@example.net", "delivering"),
    ]


async def test_an_entry_outside_ascii_matches_at_the_claim_as_in_the_batch_check(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """The list keys on one lowercasing, PostgreSQL's, wherever it is written or read: Python's
    lower() of "İ" is "i" and a combining dot, PostgreSQL's plain "i", so an entry made by hand
    in Python's form was never matched by the claim, and the address was mailed."""
    entry, _new = await suppression.add_suppression(pool, org_id, "<İnci@Example.TR>", reason="x")
    assert entry.address == await pool.fetchval("SELECT lower('İnci@example.tr')")
    await send(pool, org_id, "İnci@example.tr")
    keep, results = outcome.split_suppressed(await claim_all(pool), now=datetime.now(UTC))
    assert keep == [] and [r.outcome for r in results] == ["suppressed"]
    assert await suppressed_at_claim(pool, org_id, ["İNCİ@example.tr"]) == {"İNCİ@example.tr"}
    assert await suppression.remove_suppression(pool, org_id, "İnci@EXAMPLE.tr")


async def test_the_claim_matches_entries_in_any_case_and_ignores_expired_ones(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await suppression.add_suppression(pool, org_id, "bob@example.net", reason="x")
    await suppression.add_suppression(
        pool, org_id, "old@example.net", reason="x", expires_at=datetime.now(UTC) - timedelta(1)
    )
    await suppression.add_suppression(
        pool, org_id, "new@example.net", reason="x", expires_at=datetime.now(UTC) + timedelta(1)
    )
    found = await suppressed_at_claim(
        pool, org_id, ["BOB@example.net", "old@example.net", "new@example.net", "eve@example.net"]
    )
    assert found == {"BOB@example.net", "new@example.net"}
    listed = await suppression.list_suppressions(pool, org_id)
    assert {e.address for e in listed} == {"bob@example.net", "new@example.net"}
    everything = await suppression.list_suppressions(pool, org_id, include_expired=True)
    assert len(everything) == 3
    assert await suppression.remove_suppression(pool, org_id, "Bob@Example.net")
    assert not await suppression.remove_suppression(pool, org_id, "bob@example.net")


def test_messages_needing_bounces_groups_applied_failures_per_message() -> None:
    m1, m2, org = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    now = datetime.now(UTC)

    def r(message: uuid.UUID, outcome: Outcome) -> AttemptResult:
        return AttemptResult(uuid.uuid4(), message, org, 1, outcome, UNKNOWN, now)

    results = [
        r(m1, Outcome.BOUNCED),
        r(m1, Outcome.DELIVERED),
        r(m1, Outcome.EXPIRED),
        r(m2, Outcome.BOUNCED),
        r(m2, Outcome.SUPPRESSED),
    ]
    applied = {x.recipient_id for x in results} - {results[3].recipient_id}
    grouped = apply.messages_needing_bounces(results, applied)
    assert grouped == {m1: [results[0].recipient_id, results[2].recipient_id]}


async def test_delay_warning_tells_the_sender_once_per_recipient(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """bounces.delay_warning_after: deferred recipients older than it get one DSN per message
    (Action: delayed, the last reply, until when delivery goes on); never a second one, none for
    young or never-tried rows, none for null-sender mail (but it is marked, so not read again)."""
    old = await send(pool, org_id, "a@example.net", "b@example.net")
    young = await send(pool, org_id, "c@example.net")
    await send(pool, org_id, "e@example.net", sender="")
    greylisted = Reply(451, "4.7.1", "greylisted, come back later")
    later = datetime.now(UTC) + timedelta(hours=1)
    deferred = [
        dataclasses.replace(
            result(d, r.address, Outcome.DEFERRED, greylisted), next_attempt_at=later
        )
        for d in await claim_all(pool)
        for r in d.recipients
    ]
    assert len(await record_attempts(pool, deferred)) == 4
    await send(pool, org_id, "d@example.net")  # old but never tried: not deferred
    await pool.execute(
        "UPDATE recipient SET created_at = now() - interval '2 hours' WHERE message_id <> $1",
        young,
    )
    # a@ has waited an hour longer than b@ (b@ was retried by an operator, say):
    # the DSN promises tries only until the earlier of the two expiries.
    await pool.execute(
        "UPDATE recipient SET created_at = now() - interval '3 hours' WHERE address = 'a@example.net'"
    )

    warned = await dsn_queue.warn_delayed(pool, after=3600, max_age=5 * 86400, hostname=HOST)

    assert warned.recipients == 3  # a@, b@ and the null sender's e@
    marked = await pool.fetch(
        "SELECT address FROM recipient WHERE delay_warned_at IS NOT NULL ORDER BY address"
    )
    assert [r["address"] for r in marked] == ["a@example.net", "b@example.net", "e@example.net"]
    dsns = await queued_dsns(pool)
    assert [d["id"] for d in dsns] == warned.warnings and len(dsns) == 1
    assert dsns[0]["rcpts"] == ["alice@example.com"]
    body = bytes(dsns[0]["body"])
    assert b"Subject: Delayed mail (still being retried)" in body
    _about, *reported = delivery_status(body)
    assert sorted(b["Final-Recipient"] for b in reported) == [
        "rfc822; a@example.net",
        "rfc822; b@example.net",
    ]
    for block in reported:
        assert (block["Action"], block["Status"]) == ("delayed", "4.7.1")
        assert block["Diagnostic-Code"] == "smtp; 451 4.7.1 greylisted, come back later"
        # Tried until the first of them expires: a@ queued 3 hours ago, max_age 5 days.
        until = email.utils.parsedate_to_datetime(block["Will-Retry-Until"])
        expected = datetime.now(UTC) - timedelta(hours=3) + timedelta(days=5)
        assert abs((until - expected).total_seconds()) < 60, (until, expected)
    # Nothing else moved: the warned recipients are still queued for their next try.
    states = await pool.fetch(
        "SELECT status, next_attempt_at FROM recipient WHERE message_id = $1", old
    )
    assert all(r["status"] == "queued" and r["next_attempt_at"] > datetime.now(UTC) for r in states)

    again = await dsn_queue.warn_delayed(pool, after=3600, max_age=5 * 86400, hostname=HOST)
    assert (again.recipients, again.warnings) == (0, [])
    assert len(await queued_dsns(pool)) == 1


async def deferred_for(
    pool: asyncpg.Pool, org_id: uuid.UUID, messages: int, *, hours: float = 2
) -> None:
    """`messages` messages of one recipient each, tried once, deferred, queued `hours` ago."""
    await bulk_queue(pool, org_id, messages=messages, age=hours * 3600, due_in=600)
    await pool.execute(
        """UPDATE recipient SET attempts = 1, last_code = 451, last_enhanced_code = '4.3.0',
                  last_response = 'try later' WHERE attempts = 0 AND message_id IN (
               SELECT id FROM message WHERE sender <> '')"""
    )


async def test_a_delay_warning_that_cannot_be_queued_leaves_its_recipients_unmarked(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """The mark and the DSN commit together: when the DSN's insert fails (here a trigger that
    refuses every new message, as a full disk would), no recipient is marked as warned, so the
    next round warns them."""
    await deferred_for(pool, org_id, 3)
    await pool.execute(
        """CREATE FUNCTION refuse_messages() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN RAISE EXCEPTION 'no space left on device (test)'; END $$;
           CREATE TRIGGER refuse_messages BEFORE INSERT ON message
               FOR EACH ROW EXECUTE FUNCTION refuse_messages()"""
    )
    with pytest.raises(asyncpg.RaiseError, match="no space left"):
        await dsn_queue.warn_delayed(pool, after=3600, max_age=5 * 86400, hostname=HOST)
    assert (
        await pool.fetchval("SELECT count(*) FROM recipient WHERE delay_warned_at IS NOT NULL") == 0
    )
    assert await queued_dsns(pool) == []

    await pool.execute("DROP TRIGGER refuse_messages ON message")
    warned = await dsn_queue.warn_delayed(pool, after=3600, max_age=5 * 86400, hostname=HOST)
    assert warned.recipients == 3 and len(warned.warnings) == 3


async def test_delay_warnings_work_off_a_backlog_oldest_first_and_concurrently_once(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """More due than one round takes: the rest at the next rounds, oldest first; two rounds at
    once (two nodes) never warn about the same recipient."""
    await deferred_for(pool, org_id, 4, hours=2)  # the newer ones are written first
    await deferred_for(pool, org_id, 3, hours=3)
    first = await dsn_queue.warn_delayed(pool, after=3600, max_age=86400, hostname=HOST, limit=3)
    oldest = await pool.fetch("SELECT created_at FROM recipient WHERE delay_warned_at IS NOT NULL")
    assert first.recipients == 3
    assert all(r["created_at"] < datetime.now(UTC) - timedelta(hours=2.5) for r in oldest)
    rounds = await asyncio.gather(
        *(
            dsn_queue.warn_delayed(pool, after=3600, max_age=86400, hostname=HOST, limit=3)
            for _ in range(2)
        )
    )
    assert sorted(r.recipients for r in rounds) in ([1, 3], [0, 3], [0, 4], [2, 2], [1, 2])
    assert sum(r.recipients for r in rounds) == 4
    assert len(await queued_dsns(pool)) == 7  # one per message, none twice
    assert (
        await dsn_queue.warn_delayed(pool, after=3600, max_age=86400, hostname=HOST)
    ).recipients == 0


async def test_the_delay_warning_round_reads_only_what_is_due(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """With thousands of rows queued and deferred rows already warned, the round goes through
    recipient_warn_due (it holds only rows not warned yet), never over the whole queue."""
    await bulk_queue(pool, org_id, messages=5000, due_in=3600)
    await deferred_for(pool, org_id, 3000)
    await pool.execute("UPDATE recipient SET delay_warned_at = now() WHERE attempts > 0")
    await deferred_for(pool, org_id, 5)
    await pool.execute("ANALYZE recipient")
    async with pool.acquire() as conn:
        scans = await _recipient_scans(conn, store_dsn._MARK_DELAYED, 3600.0, 1000)
    assert ("Index Scan", "recipient_warn_due") in scans, scans
    assert all(kind != "Seq Scan" for kind, _ in scans), scans
    assert all(name in ("recipient_warn_due", "recipient_pkey", None) for _, name in scans), scans
    warned = await dsn_queue.warn_delayed(pool, after=3600, max_age=86400, hostname=HOST)
    assert warned.recipients == 5


async def test_a_retried_bounce_may_be_warned_again_a_retried_deferral_not(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """`pigeon-mta queue retry` of a bounced or expired recipient starts a new life in the queue
    (created_at restarts), so its sender may be warned again; retrying a deferred one is a nudge."""
    await deferred_for(pool, org_id, 2)
    await dsn_queue.warn_delayed(pool, after=3600, max_age=86400, hostname=HOST)
    first, second = await pool.fetch("SELECT id FROM recipient WHERE attempts > 0 ORDER BY id")
    await pool.execute("UPDATE recipient SET status = 'bounced' WHERE id = $1", first["id"])
    async with pool.acquire() as conn:
        selection = admin_queue.Selection(ids=(first["id"], second["id"]))
        done = await admin_queue.bulk_action(conn, "retry", selection, dry_run=False)
    assert done.count == 2
    marks = {
        r["id"]: r["delay_warned_at"]
        for r in await pool.fetch("SELECT id, delay_warned_at FROM recipient")
    }
    assert marks[first["id"]] is None and marks[second["id"]] is not None


async def test_a_delay_warning_promises_retries_only_until_the_lane_max_age(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A bulk recipient queued 3 hours ago, in a lane whose max_age is 1 day, under a
    delivery.max_age of 5 days: tried until 1 day after it was queued."""
    await bulk_queue(pool, org_id, messages=1, age=3 * 3600, due_in=600, lane="bulk")
    await pool.execute(
        """UPDATE recipient SET attempts = 1, last_code = 451, last_enhanced_code = '4.7.1',
                  last_response = 'later'"""
    )
    bulk_day = upkeep.LaneMaxAge("bulk", 86400, "1d")
    warned = await dsn_queue.warn_delayed(
        pool, after=3600, max_age=5 * 86400, hostname=HOST, lane_max_ages=[bulk_day]
    )
    assert warned.recipients == 1
    [dsn] = await queued_dsns(pool)
    _about, reported = delivery_status(bytes(dsn["body"]))
    until = email.utils.parsedate_to_datetime(reported["Will-Retry-Until"])
    expected = datetime.now(UTC) - timedelta(hours=3) + timedelta(days=1)
    assert abs((until - expected).total_seconds()) < 60, (until, expected)
