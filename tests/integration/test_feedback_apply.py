"""Feedback kept in the database, read and applied by the feedback processor on a real
PostgreSQL: async bounces and complaints move, suppress and announce once, whatever repeats,
comes out of order or lies.

test --keep--> feedback table --FeedbackProcessor.process--> feedback_event, recipient,
                                                             suppression, webhook_event
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import asyncpg
import pytest

from pigeon_mta.config import BounceSettings, Duration, Settings
from pigeon_mta.delivery_records import story_records
from pigeon_mta.feedback.processor import FeedbackProcessor
from pigeon_mta.feedback.return_paths import ReturnPaths
from pigeon_mta.feedback.tokens import return_path
from pigeon_mta.store import events
from pigeon_mta.store import feedback as store_feedback
from pigeon_mta.store import return_path as store_return_path
from pigeon_mta.store.domains import add_sender_domain
from pigeon_mta.store.orgs import ensure_org
from pigeon_mta.store.webhooks import add_webhook
from tests.integration.outbound_helpers import send
from tests.peers import feedback_reports as reports

RETURN_PATH = "bounces.acme.example"


@dataclasses.dataclass
class World:
    pool: asyncpg.Pool
    acme: uuid.UUID
    other: uuid.UUID
    paths: ReturnPaths
    processor: FeedbackProcessor

    async def sent(
        self, address: str, *, org: uuid.UUID | None = None, status: str = "delivered"
    ) -> tuple[uuid.UUID, uuid.UUID]:
        """A message to `address` in that state: (queue id, recipient id)."""
        org = org or self.acme
        sender = "app@acme.example" if org == self.acme else "app@other.example"
        queue_id = await send(self.pool, org, address, sender=sender)
        recipient_id = await self.pool.fetchval(
            "UPDATE recipient SET status = $2, attempts = 1 WHERE message_id = $1 RETURNING id",
            queue_id,
            status,
        )
        return queue_id, recipient_id

    def verp(self, recipient_id: uuid.UUID) -> str:
        key = self.paths.signing
        assert key is not None
        return return_path(key, recipient_id, RETURN_PATH)

    async def keep(self, body: bytes, *, to: str) -> tuple[uuid.UUID, bool]:
        from pigeon_mta.message import message_id_of, split_header

        return await store_feedback.keep(
            self.pool,
            key=store_feedback.report_key(message_id_of(split_header(body).fields), body),
            listener="feedback",
            client_ip="127.0.0.1",
            helo="mx.dest.test",
            mail_from="",
            rcpt_to=[to],
            body=body,
        )

    async def status(self, recipient_id: uuid.UUID) -> str:
        return str(
            await self.pool.fetchval("SELECT status FROM recipient WHERE id = $1", recipient_id)
        )

    async def suppressed(self, org: uuid.UUID, address: str) -> asyncpg.Record | None:
        return await self.pool.fetchrow(
            "SELECT reason, source, feedback_event_id FROM suppression"
            " WHERE org_id = $1 AND address = lower($2)",
            org,
            address,
        )

    async def feedback(self, feedback_id: uuid.UUID) -> asyncpg.Record:
        row = await self.pool.fetchrow(
            "SELECT status, kind, detail FROM feedback WHERE id = $1", feedback_id
        )
        assert row is not None
        return row

    async def events(self) -> list[asyncpg.Record]:
        return await self.pool.fetch(
            "SELECT recipient_id, kind, hard, code, enhanced_code, category, feedback_type,"
            " changed_state FROM feedback_event ORDER BY recorded_at, id"
        )

    async def webhook_events(self) -> list[dict]:
        rows = await self.pool.fetch("SELECT payload FROM webhook_event ORDER BY id")
        return [json.loads(r["payload"]) for r in rows]


@pytest.fixture
async def world(pool: asyncpg.Pool) -> World:
    acme = await ensure_org(pool, "acme")
    other = await ensure_org(pool, "other")
    await add_sender_domain(pool, acme, "acme.example")
    await add_sender_domain(pool, other, "other.example")
    assert await store_return_path.set_return_path(pool, "acme.example", RETURN_PATH)
    await add_webhook(pool, acme, "http://127.0.0.1:9/hook", ["bounced", "complained"], "whsec_x")
    settings = dataclasses.replace(
        Settings(), bounces=BounceSettings(feedback_max_age=Duration(86400))
    )
    paths = ReturnPaths(settings, pool)
    await paths.refresh()
    return World(pool, acme, other, paths, FeedbackProcessor(pool, paths))


async def test_an_async_bounce_bounces_suppresses_and_announces_once(world: World) -> None:
    queue_id, rid = await world.sent("nobody@dest.test")
    verp = world.verp(rid)
    body = reports.dsn(to=verp, recipient="nobody@dest.test")
    first, new = await world.keep(body, to=verp)
    assert new
    # The same DSN twice more: kept once.
    for _ in range(2):
        again, new = await world.keep(body, to=verp)
        assert (again, new) == (first, False)
    assert await world.processor.process() == 1
    assert await world.status(rid) == "bounced"
    assert (await world.feedback(first))["status"] == "applied"
    [event] = await world.events()
    assert (event["kind"], event["hard"], event["code"], event["enhanced_code"]) == (
        "bounce",
        True,
        550,
        "5.1.1",
    )
    assert event["changed_state"] is True
    entry = await world.suppressed(world.acme, "nobody@dest.test")
    assert entry is not None and entry["source"] == "bounce"
    [hook] = await world.webhook_events()
    assert hook["type"] == "bounced" and hook["data"]["async"] is True
    assert hook["data"]["queue_id"] == str(queue_id) and hook["data"]["code"] == 550
    # The story says so, as `pigeon-mta log` and the API's timeline tell it.
    lookup = await events.find_stories(world.pool, str(queue_id), limit=5)
    assert lookup is not None
    [story] = lookup.stories
    last = story_records(story)[-1]
    assert (last["type"], last["async"], last["code"], last["changed_state"]) == (
        "Bounce",
        True,
        550,
        True,
    )
    assert last["feedback_id"] == str(first)
    # Another DSN for the same recipient (another Message-ID) changes nothing more.
    await world.keep(reports.dsn(to=verp, recipient="nobody@dest.test", report_id="x@y"), to=verp)
    assert await world.processor.process() == 1
    assert len(await world.events()) == 1 and len(await world.webhook_events()) == 1


async def test_a_dsn_for_a_recipient_still_deferred_records_and_suppresses_only(
    world: World,
) -> None:
    _queue_id, rid = await world.sent("later@dest.test", status="queued")
    verp = world.verp(rid)
    await world.keep(reports.dsn(to=verp, recipient="later@dest.test"), to=verp)
    await world.processor.process()
    assert await world.status(rid) == "queued"  # its next claim finds it suppressed
    [event] = await world.events()
    assert event["changed_state"] is False
    assert await world.suppressed(world.acme, "later@dest.test") is not None


async def test_a_full_mailbox_is_recorded_and_changes_nothing(world: World) -> None:
    _queue_id, rid = await world.sent("full@dest.test")
    verp = world.verp(rid)
    body = reports.dsn(
        to=verp,
        recipient="full@dest.test",
        status="5.2.2",
        diagnostic="smtp; 552 5.2.2 <{recipient}>: Mailbox full",
    )
    await world.keep(body, to=verp)
    await world.processor.process()
    assert await world.status(rid) == "delivered"
    [event] = await world.events()
    assert (event["hard"], event["category"]) == (False, "mailbox-full")
    assert await world.suppressed(world.acme, "full@dest.test") is None
    assert await world.webhook_events() == []


async def test_a_complaint_suppresses_and_emits_complained(world: World) -> None:
    queue_id, rid = await world.sent("ann@yahoo.test")
    verp = world.verp(rid)
    # Yahoo-shaped: to the complaint address, no Original-Rcpt-To, our return path inside.
    body = reports.arf(recipient_in_original="ann@yahoo.test", return_path=verp)
    feedback_id, _new = await world.keep(body, to="fbl@acme.example")
    await world.processor.process()
    assert (await world.feedback(feedback_id))["status"] == "applied"
    assert await world.status(rid) == "delivered"
    [event] = await world.events()
    assert (event["kind"], event["feedback_type"]) == ("complaint", "abuse")
    entry = await world.suppressed(world.acme, "ann@yahoo.test")
    assert entry is not None and entry["source"] == "complaint"
    [hook] = await world.webhook_events()
    assert hook["type"] == "complained" and hook["data"]["queue_id"] == str(queue_id)


async def test_a_complaint_without_a_token_is_matched_by_message_id_and_address(
    world: World,
) -> None:
    _queue_id, rid = await world.sent("bob@dest.test")
    header_id = await world.pool.fetchval(
        "SELECT m.header_message_id FROM message m JOIN recipient r ON r.message_id = m.id"
        " WHERE r.id = $1",
        rid,
    )
    body = reports.arf(original_rcpt_to="Bob@dest.test", message_id=header_id)
    await world.keep(body, to="fbl@acme.example")
    await world.processor.process()
    [event] = await world.events()
    assert event["recipient_id"] == rid


async def test_a_token_touches_only_its_own_recipient_whatever_the_dsn_names(
    world: World,
) -> None:
    _q, mine = await world.sent("mine@dest.test")
    _q, theirs = await world.sent("theirs@dest.test", org=world.other)
    verp = world.verp(mine)
    await world.keep(reports.dsn(to=verp, recipient="theirs@dest.test"), to=verp)
    await world.processor.process()
    assert await world.status(theirs) == "delivered"
    assert await world.suppressed(world.other, "theirs@dest.test") is None
    [event] = await world.events()
    assert event["recipient_id"] == mine


async def test_forged_and_expired_tokens_and_replies_change_nothing(world: World) -> None:
    _q, rid = await world.sent("ann@dest.test")
    verp = world.verp(rid)
    local, _, domain = verp.partition("@")
    forged = f"{local[:-1]}{'a' if local[-1] != 'a' else 'b'}@{domain}"
    forged_id, _ = await world.keep(reports.dsn(to=forged, recipient="ann@dest.test"), to=forged)
    # The key retires, and is past feedback_max_age: its tokens name nobody any more.
    await store_return_path.rotate_key(world.pool)
    await world.pool.execute(
        "UPDATE return_path_key SET retired_at = now() - interval '2 days'"
        " WHERE retired_at IS NOT NULL"
    )
    await world.paths.refresh()
    expired_id, _ = await world.keep(
        reports.dsn(to=verp, recipient="ann@dest.test", report_id="late@mx"), to=verp
    )
    reply_id, _ = await world.keep(reports.human_reply(to=verp), to=verp)
    assert await world.processor.process() == 3
    assert (await world.feedback(forged_id))["status"] == "unmatched"
    assert (await world.feedback(expired_id))["status"] == "unmatched"
    assert (await world.feedback(reply_id))["status"] == "not-understood"
    assert await world.events() == []
    assert await world.status(rid) == "delivered"


async def test_a_retired_key_still_verifies_within_feedback_max_age(world: World) -> None:
    _q, rid = await world.sent("ann@dest.test")
    verp = world.verp(rid)
    await store_return_path.rotate_key(world.pool)
    await world.paths.refresh()
    assert world.verp(rid) != verp  # new mail is signed with the new key
    await world.keep(reports.dsn(to=verp, recipient="ann@dest.test"), to=verp)
    await world.processor.process()
    assert await world.status(rid) == "bounced"


async def test_a_manual_suppression_stays_as_the_operator_left_it(world: World) -> None:
    from pigeon_mta.store.suppression import add_suppression

    _q, rid = await world.sent("kept@dest.test")
    await add_suppression(world.pool, world.acme, "kept@dest.test", reason="asked by phone")
    verp = world.verp(rid)
    await world.keep(reports.dsn(to=verp, recipient="kept@dest.test"), to=verp)
    await world.processor.process()
    entry = await world.suppressed(world.acme, "kept@dest.test")
    assert entry is not None and (entry["source"], entry["reason"]) == ("manual", "asked by phone")


async def test_forward_to_sender_queues_a_dsn_for_what_a_report_bounced(world: World) -> None:
    queue_id, rid = await world.sent("gone@dest.test")
    _q, full = await world.sent("full@dest.test")
    forwarding = FeedbackProcessor(world.pool, world.paths, forward_to="mta.test")
    verp, verp_full = world.verp(rid), world.verp(full)
    await world.keep(reports.dsn(to=verp, recipient="gone@dest.test"), to=verp)
    body = reports.dsn(
        to=verp_full,
        recipient="full@dest.test",
        status="5.2.2",
        report_id="full@mx",
        diagnostic="smtp; 552 5.2.2 <{recipient}>: Mailbox full",
    )
    await world.keep(body, to=verp_full)
    await forwarding.process()
    # One DSN, from the null sender to the original's sender, about the hard bounce only.
    [dsn] = await world.pool.fetch(
        "SELECT m.sender, m.listener, r.address, convert_from(m.body, 'UTF8') AS body"
        " FROM message m JOIN recipient r ON r.message_id = m.id WHERE m.listener = 'bounce'"
    )
    assert (dsn["sender"], dsn["address"]) == ("", "app@acme.example")
    assert "gone@dest.test" in dsn["body"] and "full@dest.test" not in dsn["body"]
    assert f"X-Pigeon-Queue-ID: {queue_id}" in dsn["body"]
    assert "Status: 5.1.1" in dsn["body"]


async def test_a_batch_reads_a_bounded_amount_of_bodies(world: World) -> None:
    verp = world.verp((await world.sent("a@dest.test"))[1])
    for i in range(3):
        body = reports.human_reply(to=verp).replace(b"reply-1@", f"reply-{i}@".encode())
        await world.keep(body + b"x" * 400_000, to=verp)
    async with world.pool.acquire() as conn, conn.transaction():
        taken = await store_feedback.take_new(conn, 200, max_bytes=1_000_000)
        assert len(taken) == 2  # the third would pass the bound: the next batch's
        async with world.pool.acquire() as other, other.transaction():
            # All three stay locked by the first batch: another processor passes them by.
            assert await store_feedback.take_new(other, 200) == []
    async with world.pool.acquire() as conn, conn.transaction():
        first = await store_feedback.take_new(conn, 200, max_bytes=10)
        assert len(first) == 1  # one at least, whatever its size


async def test_a_dsn_faster_than_the_record_of_its_delivery_waits_for_it(world: World) -> None:
    # A gateway that bounces at once: the DSN is kept while the recipient is still
    # `delivering` (the recorder has not committed the 250 yet).
    _q, rid = await world.sent("quick@dest.test", status="delivering")
    verp = world.verp(rid)
    feedback_id, _new = await world.keep(reports.dsn(to=verp, recipient="quick@dest.test"), to=verp)
    await world.processor.process()
    row = await world.feedback(feedback_id)
    assert row["status"] == "new" and "read again" in row["detail"]
    assert await world.events() == []
    assert await world.processor.process() == 0  # not read again at once
    # The delivery is recorded; the next read after READ_AGAIN applies the report.
    await world.pool.execute("UPDATE recipient SET status = 'delivered' WHERE id = $1", rid)
    await world.pool.execute("UPDATE feedback SET read_at = now() WHERE id = $1", feedback_id)
    assert await world.processor.process() == 1
    assert (await world.feedback(feedback_id))["status"] == "applied"
    assert await world.status(rid) == "bounced"
