"""A tenant's reputation on a real PostgreSQL: counted as it is recorded, an org over its complaint
or bounce threshold is paused within one evaluation while another org's mail keeps being claimed;
`org resume` releases what waited, and the same rates do not pause it again at once.

test --attempts, feedback events--> PostgreSQL --reputation.evaluate--> suspension (org, kind
'reputation') --> the claim passes the org's mail by
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import asyncpg

from pigeon_mta import reputation
from pigeon_mta.config import ReputationSettings, Settings
from pigeon_mta.store import reputation as store_reputation
from pigeon_mta.store import suspensions
from pigeon_mta.store.orgs import ensure_org
from pigeon_mta.store.webhooks import EVENT_TYPES, add_webhook
from tests.e2e.shared import pigeon_json
from tests.integration.queue_helpers import bulk_queue, claim

SETTINGS = dataclasses.replace(
    Settings(), reputation=ReputationSettings(min_volume=100, pause_complaint_rate=0.005)
)


async def history(
    pool: asyncpg.Pool | asyncpg.Connection,
    org: uuid.UUID,
    *,
    delivered: int,
    bounced: int = 0,
    complaints: int = 0,
    minutes_ago: int = 5,
    lane: str = "transactional",
) -> None:
    """Recipients delivered and hard-bounced `minutes_ago`, with attempt rows as the record writes
    them, and complaints about the first of the delivered ones as the feedback processor does."""
    rows = await pool.fetch(
        """WITH m AS (
               INSERT INTO message (id, org_id, sender, body, size, listener, received_at)
               SELECT gen_random_uuid(), $1, 'app@acme.example', 'x', 1, 'test', now()
               FROM generate_series(1, $2::int + $3::int) RETURNING id)
           INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts,
                                  created_at, next_attempt_at, lane)
           SELECT gen_random_uuid(), m.id, $1, 'r' || row_number() OVER () || '@dest.test',
                  'dest.test', 'delivered', 1, now(), now(), $4
           FROM m RETURNING id, message_id""",
        org,
        delivered,
        bounced,
        lane,
    )
    when = f"now() - interval '{minutes_ago} minutes'"
    for i, row in enumerate(rows):
        bounce = i >= delivered
        await pool.execute(
            f"""INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at,
                                    outcome, category, applied, recorded_at)
                VALUES (gen_random_uuid(), $1, $2, $3, 1, {when}, $4, $5, true, {when})""",
            row["id"],
            row["message_id"],
            org,
            "bounced" if bounce else "delivered",
            "invalid-recipient" if bounce else None,
        )
    if complaints:
        feedback = await pool.fetchval(
            """INSERT INTO feedback (id, report_key, listener, mail_from, rcpt_to, body, status)
               VALUES (gen_random_uuid(), 'k-' || gen_random_uuid(), 'feedback', '', '{}', 'x',
                       'applied') RETURNING id"""
        )
        for row in rows[:complaints]:
            await pool.execute(
                f"""INSERT INTO feedback_event (id, feedback_id, recipient_id, message_id, org_id,
                                               lane, address, kind, hard, recorded_at)
                    VALUES (gen_random_uuid(), $1, $2, $3, $4, $5, 'x@dest.test',
                            'complaint', true, {when})""",
                feedback,
                row["id"],
                row["message_id"],
                org,
                lane,
            )


async def paused(pool: asyncpg.Pool, org: uuid.UUID) -> asyncpg.Record | None:
    return await pool.fetchrow(
        "SELECT reason, kind FROM suspension WHERE key = $1", suspensions.ORG + str(org)
    )


async def org_events(pool: asyncpg.Pool) -> list[tuple[str, str, str]]:
    """The org events written for webhooks, oldest first: (type, org, by)."""
    rows = await pool.fetch(
        """SELECT payload FROM webhook_event WHERE type IN ('paused', 'resumed')
           ORDER BY created_at, id"""
    )
    events = [json.loads(r["payload"]) for r in rows]
    return [(e["type"], e["data"]["org"], e["data"]["by"]) for e in events]


async def test_complaints_over_the_threshold_pause_that_org_alone(
    pool: asyncpg.Pool, db_url: str
) -> None:
    noisy = await ensure_org(pool, "noisy")
    quiet = await ensure_org(pool, "quiet")
    # The mark starts at the migration: what was recorded before it was never counted.
    await pool.execute("UPDATE reputation_mark SET counted_to = now() - interval '1 hour'")
    await history(pool, noisy, delivered=600, complaints=6)  # 1%
    await history(pool, noisy, delivered=400, complaints=2, lane="bulk")  # 0.5%
    await history(pool, quiet, delivered=1000, complaints=2)  # 0.2%
    await bulk_queue(pool, noisy, messages=5, domain="a.test")
    await bulk_queue(pool, quiet, messages=5, domain="a.test")
    for org in (noisy, quiet):
        await add_webhook(pool, org, f"https://hooks.example/{org}", EVENT_TYPES, "whsec_x")

    assert await reputation.evaluate(pool, SETTINGS) == ["noisy"]
    row = await paused(pool, noisy)
    assert row is not None and row["kind"] == "reputation"
    assert row["reason"].startswith("complaint rate 0.80% over 24h (8 of 1000")
    assert await paused(pool, quiet) is None
    # The org's endpoint gets `paused` with the reason and the rates; the other org's gets nothing.
    assert await org_events(pool) == [("paused", "noisy", "reputation")]
    payload = json.loads(await pool.fetchval("SELECT payload FROM webhook_event"))
    assert payload["data"]["reason"] == row["reason"]
    assert (payload["data"]["complaints"], payload["data"]["sent"]) == (8, 1000)
    assert payload["data"]["complaint_rate"] == 0.008
    # `queue` and `org show` say so.
    shown = await asyncio.to_thread(pigeon_json, db_url, "queue")
    rows = {r["org"]: r for r in shown["reputation"]}
    assert rows["noisy"]["complaint_rate"] == 0.008 and rows["noisy"]["paused"] == row["reason"]
    assert rows["quiet"]["paused"] is None and rows["quiet"]["sent"] == 1000
    org = await asyncio.to_thread(pigeon_json, db_url, "org", "show", "noisy")
    assert (org["sent"], org["complaints"], org["paused"]) == (1000, 8, row["reason"])
    assert [(lane["lane"], lane["sent"], lane["complaint_rate"]) for lane in org["lanes"]] == [
        ("bulk", 400, 0.005),
        ("transactional", 600, 0.01),
    ]
    # Nothing of the paused org is claimed, nor attempted; the other org's mail flows.
    claimed = await claim(pool, owner="node-a", lease=60, batch=100)
    assert {d.org_id for d in claimed} == {quiet}
    # Counted once: a second round adds nothing and pauses nobody more.
    assert await reputation.evaluate(pool, SETTINGS) == []
    [rates] = await store_reputation.rates(pool, window=86400, org_id=noisy)
    assert (rates.sent, rates.complained) == (1000, 8)
    assert await org_events(pool) == [("paused", "noisy", "reputation")]

    # `org resume`: the mail is claimed again, and the same rates do not pause it at once.
    async with pool.acquire() as conn:
        assert await suspensions.resume(conn, suspensions.ORG + str(noisy))
    await store_reputation.mark_resumed(pool, noisy)
    assert await reputation.evaluate(pool, SETTINGS) == []
    claimed = await claim(pool, owner="node-a", lease=60, batch=100)
    assert {d.org_id for d in claimed} == {noisy}
    assert await org_events(pool) == [
        ("paused", "noisy", "reputation"),
        ("resumed", "noisy", "operator"),
    ]


async def test_hard_bounces_pause_and_little_mail_never_does(pool: asyncpg.Pool) -> None:
    bouncy = await ensure_org(pool, "bouncy")
    small = await ensure_org(pool, "small")
    await pool.execute("UPDATE reputation_mark SET counted_to = now() - interval '1 hour'")
    await history(pool, bouncy, delivered=850, bounced=150)  # 15% of 1000
    await history(pool, small, delivered=40, bounced=30, complaints=5)  # 70 sent: too few
    assert await reputation.evaluate(pool, SETTINGS) == ["bouncy"]
    row = await paused(pool, bouncy)
    assert row is not None and "hard-bounce rate 15.00%" in row["reason"]
    assert await paused(pool, small) is None


async def test_an_operators_suspension_is_not_replaced(pool: asyncpg.Pool) -> None:
    noisy = await ensure_org(pool, "noisy")
    await pool.execute("UPDATE reputation_mark SET counted_to = now() - interval '1 hour'")
    await history(pool, noisy, delivered=1000, complaints=50)
    await add_webhook(pool, noisy, "https://hooks.example/n", ("paused",), "whsec_x")
    async with pool.acquire() as conn:
        await suspensions.suspend(conn, suspensions.ORG + str(noisy), reason="audit", seconds=None)
    assert await reputation.evaluate(pool, SETTINGS) == []
    row = await paused(pool, noisy)
    assert row is not None and (row["reason"], row["kind"]) == ("audit", "operator")
    # One `paused` event, the operator's; `resumed` is not among the endpoint's types.
    assert await org_events(pool) == [("paused", "noisy", "operator")]
    async with pool.acquire() as conn:
        assert await suspensions.resume(conn, suspensions.ORG + str(noisy))
    assert await org_events(pool) == [("paused", "noisy", "operator")]


async def test_what_is_older_than_the_window_does_not_count(pool: asyncpg.Pool) -> None:
    old = await ensure_org(pool, "old")
    await pool.execute("UPDATE reputation_mark SET counted_to = now() - interval '3 days'")
    await history(pool, old, delivered=1000, complaints=50, minutes_ago=60 * 30)
    assert await reputation.evaluate(pool, SETTINGS) == []
    [rates] = await store_reputation.rates(pool, window=86400, org_id=old)
    assert rates.sent == 0
