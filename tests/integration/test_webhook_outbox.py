"""The webhook outbox through the real store: events written by the statements that record
outcomes and expiries, and the sender's claims of them."""

from __future__ import annotations

import collections
import dataclasses
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from pigeon_mta.model import DSN_LISTENER, Envelope, Outcome, Reply
from pigeon_mta.outbound import outcome
from pigeon_mta.store import outcomes, queue, upkeep
from pigeon_mta.store import webhooks as store_webhooks
from tests.integration.queue_helpers import record_attempts
from tests.integration.test_bounces import claim_all, result

BODY = b"From: alice@example.com\r\nMessage-ID: <m1@example.com>\r\n\r\nhi\r\n"


async def send(
    pool: asyncpg.Pool, org_id: uuid.UUID, *recipients: str, listener: str = "relay"
) -> uuid.UUID:
    return await queue.enqueue(
        pool,
        Envelope(
            org_id=org_id,
            sender="alice@example.com",
            recipients=recipients,
            body=BODY,
            listener=listener,
            header_message_id="m1@example.com",
        ),
    )


async def events(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    rows = await pool.fetch("SELECT type, payload FROM webhook_event ORDER BY id")
    return [{"row_type": r["type"], **json.loads(r["payload"])} for r in rows]


async def test_expiry_writes_an_expired_event_with_the_last_reply(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["expired"], "whsec_x")
    queue_id = await send(pool, org_id, "bob@example.net")
    [delivery] = await claim_all(pool)
    later = datetime.now(UTC)
    greylisted = Reply(451, "4.7.1", "greylisted")
    deferred = dataclasses.replace(
        result(delivery, "bob@example.net", Outcome.DEFERRED, greylisted), next_attempt_at=later
    )
    await record_attempts(pool, [deferred])
    assert await events(pool) == []  # deferred: not asked for
    await pool.execute("UPDATE recipient SET created_at = now() - interval '6 days'")

    expired = await upkeep.expire_old_recipients(pool, max_age=5 * 86400, max_age_text="5d")

    assert len(expired) == 1
    [event] = await events(pool)
    assert (event["row_type"], event["type"]) == ("expired", "expired")
    assert event["data"] == {
        "queue_id": str(queue_id),
        "recipient_id": str(expired[0].recipient_id),
        "recipient": "bob@example.net",
        "message_id": "m1@example.com",
        "code": 451,
        "enhanced_code": "4.7.1",
        "response": "expired after 5d in the queue; last reply: greylisted",
        "category": "expired",
        "attempt": 1,
        "kind": "message",
        "metadata": {},
        "next_attempt_at": None,
        "sender": "alice@example.com",
        "lane": "transactional",
    }


async def test_suppressed_outcomes_are_events_and_stale_claims_are_not(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["suppressed"], "s")
    await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:2/", ["delivered"], "s")
    await send(pool, org_id, "gone@example.net", "ok@example.net")
    await pool.execute(
        "INSERT INTO suppression (id, org_id, address, reason, source) "
        "VALUES (gen_random_uuid(), $1, 'gone@example.net', 'by hand', 'manual')",
        org_id,
    )
    [delivery] = await claim_all(pool)
    keep, suppressed = outcome.split_suppressed([delivery], now=datetime.now(UTC))
    ok = result(keep[0], "ok@example.net", Outcome.DELIVERED, Reply(250, "2.0.0", "ok"))
    stale = dataclasses.replace(ok, attempt=ok.attempt + 1)  # a claim that no longer holds

    await record_attempts(pool, [*suppressed, stale])
    await record_attempts(pool, [ok])

    found = sorted((e["type"], e["data"]["recipient"]) for e in await events(pool))
    assert found == [("delivered", "ok@example.net"), ("suppressed", "gone@example.net")]


async def test_the_record_writes_events_within_an_offer_claimed_and_returns_them(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A sender offers room: 1 on `busy` (it has requests in flight there), none on `full`, 2 on
    every other webhook. Of 3 delivered recipients, each webhook's events within its room are
    written claimed (due after the lease) and come back whole; the rest wait, due at once."""
    busy = await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["delivered"], "a")
    full = await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:2/", ["delivered"], "b")
    other = await store_webhooks.add_webhook(
        pool, org_id, "http://127.0.0.1:3/", ["delivered"], "c"
    )
    addresses = ("a@example.net", "b@example.net", "c@example.net")
    queue_id = await send(pool, org_id, *addresses)
    [delivery] = await claim_all(pool)
    ok = Reply(250, "2.0.0", "ok")
    results = [result(delivery, a, Outcome.DELIVERED, ok) for a in addresses]
    offer = store_webhooks.Offer({busy.id: 1, full.id: 0}, other=2, lease=600)

    recorded = await outcomes.record_outcomes(pool, results, offer)

    assert recorded.applied == {r.recipient_id for r in results}
    handed = collections.Counter(e.webhook_id for e in recorded.events)
    assert handed == {busy.id: 1, other.id: 2}
    assert recorded.waiting == {full.id, busy.id, other.id}  # 3, 2 and 1 beyond their room
    by_id = {e.id: e for e in recorded.events}
    rows = await pool.fetch(
        "SELECT id, webhook_id, attempts, payload::text AS body, "
        "next_attempt_at - now() AS due_in FROM webhook_event"
    )
    assert len(rows) == 9
    for row in rows:
        if row["id"] in by_id:
            event = by_id[row["id"]]
            assert (row["attempts"], event.attempts) == (1, 1)
            assert row["due_in"].total_seconds() > 590  # leased to the sender
            assert event.body == row["body"].encode()
            assert event.url == {busy.id: busy.url, other.id: other.url}[row["webhook_id"]]
            assert event.secret == {busy.id: "a", other.id: "c"}[row["webhook_id"]]
            assert json.loads(event.body)["data"]["queue_id"] == str(queue_id)
        else:
            assert row["attempts"] == 0 and row["due_in"].total_seconds() <= 0
    # The waiting ones are the outbox's: a claim finds exactly them.
    claimed = await store_webhooks.claim_due_events(pool, room=10, busy={}, lease=60)
    assert {e.id for e in claimed} == {r["id"] for r in rows} - set(by_id)


async def test_a_record_with_no_offer_leaves_every_event_to_a_claim(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    hook = await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["delivered"], "a")
    await send(pool, org_id, "a@example.net")
    [delivery] = await claim_all(pool)
    ok = result(delivery, "a@example.net", Outcome.DELIVERED, Reply(250, "2.0.0", "ok"))

    recorded = await outcomes.record_outcomes(pool, [ok])

    assert (recorded.events, recorded.waiting) == ([], {hook.id})
    [claimed] = await store_webhooks.claim_due_events(pool, room=8, busy={}, lease=60)
    assert claimed.attempts == 1


async def test_a_claim_takes_no_more_than_the_room_of_each_endpoint(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    first = await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["x"], "s")
    second = await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:2/", ["x"], "s")
    for hook in (first, second):
        await pool.execute(
            "INSERT INTO webhook_event (id, webhook_id, type, payload) "
            "SELECT gen_random_uuid(), $1, 'delivered', '{}' FROM generate_series(1, 5)",
            hook.id,
        )
    claimed = await store_webhooks.claim_due_events(pool, room=3, busy={first.id: 2}, lease=60)
    by_hook = [e.webhook_id for e in claimed]
    assert (by_hook.count(first.id), by_hook.count(second.id)) == (1, 3)
    # Claimed events are not due again until their lease passes.
    again = await store_webhooks.claim_due_events(pool, room=10, busy={}, lease=60)
    assert len(again) == 10 - 4 and not {e.id for e in again} & {e.id for e in claimed}
    # An outcome counts only for the claim that made the request.
    event = claimed[0]
    stale = dataclasses.replace(event, attempts=event.attempts + 1)
    await store_webhooks.record_event_results(
        pool,
        [store_webhooks.EventResult(stale, store_webhooks.DELIVERED, 204, None)],
    )
    assert await pool.fetchval("SELECT state FROM webhook_event WHERE id = $1", event.id) == (
        "pending"
    )
    await store_webhooks.release_events(pool, [event])
    row = await pool.fetchrow(
        "SELECT attempts, next_attempt_at <= now() AS due FROM webhook_event WHERE id = $1",
        event.id,
    )
    assert row is not None and (row["attempts"], row["due"]) == (0, True)


async def test_removing_an_org_removes_its_webhooks_and_their_events(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    from pigeon_mta.store import orgs

    hook = await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["x"], "s")
    await pool.execute(
        "INSERT INTO webhook_event (id, webhook_id, type, payload) "
        "VALUES (gen_random_uuid(), $1, 'delivered', '{}')",
        hook.id,
    )
    async with pool.acquire() as conn:
        assert await orgs.remove_org(conn, "acme", force=False) is not None
    assert await pool.fetchval("SELECT count(*) FROM webhook") == 0
    assert await pool.fetchval("SELECT count(*) FROM webhook_event") == 0


async def test_an_event_of_a_dsn_says_so(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    """A delivery status notification pigeon-mta queued for the org's sender is delivered under
    a queue id the application never made: its events say `kind: "dsn"`; the org's own mail's
    say "message"."""
    await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["delivered"], "s")
    dsn = await send(pool, org_id, "alice@example.com", listener=DSN_LISTENER)
    mail = await send(pool, org_id, "bob@example.net")
    deliveries = await claim_all(pool)
    delivered = [
        result(d, r.address, Outcome.DELIVERED, Reply(250, "2.0.0", "ok"))
        for d in deliveries
        for r in d.recipients
    ]
    await record_attempts(pool, delivered)
    kinds = {e["data"]["queue_id"]: e["data"]["kind"] for e in await events(pool)}
    assert kinds == {str(dsn): "dsn", str(mail): "message"}


async def test_a_deferred_event_says_when_it_is_tried_again_and_what_the_message_is(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:1/", ["deferred"], "whsec_x")
    queue_id = await send(pool, org_id, "bob@example.net")
    [delivery] = await claim_all(pool)
    later = datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    greylisted = Reply(451, "4.7.1", "greylisted")
    deferred = dataclasses.replace(
        result(delivery, "bob@example.net", Outcome.DEFERRED, greylisted), next_attempt_at=later
    )
    await record_attempts(pool, [deferred])
    [event] = await events(pool)
    assert event["type"] == "deferred"
    data = event["data"]
    assert data["next_attempt_at"] == "2030-01-02T03:04:05.678Z"
    assert (data["queue_id"], data["sender"], data["lane"], data["kind"]) == (
        str(queue_id),
        "alice@example.com",
        "transactional",
        "message",
    )
