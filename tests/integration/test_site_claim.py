"""The site claim: mail waiting in a site's queue is claimed as far as the site's budget has room,
shared between the orgs and lanes waiting, and left untouched while there is none."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import asyncpg

from pigeon_mta.outbound.claims import group_deliveries
from pigeon_mta.store import claims, leases, suspensions
from pigeon_mta.store.orgs import ensure_org
from tests.integration.queue_helpers import LANE_WEIGHTS, bulk_queue

SITE = "destination:site:mx1.shared.test,mx2.shared.test"
RATE = 40.0
AHEAD = 0.25


async def budget(pool: asyncpg.Pool, *, tokens: float, held_for: float = 0.0) -> None:
    await pool.execute(
        """INSERT INTO budget (key, rate, burst, effective_rate, tokens, refilled_at, held_until)
           VALUES ($1, $2, $2, $2, $3, clock_timestamp(),
                   CASE WHEN $4 > 0 THEN now() + make_interval(secs => $4) END)""",
        SITE,
        RATE,
        tokens,
        held_for,
    )


async def in_site_queue(
    pool: asyncpg.Pool, org_id: uuid.UUID, messages: int, lane: str = "transactional"
) -> None:
    """`messages` recipients of `org_id` waiting in the site's queue."""
    await bulk_queue(pool, org_id, messages=messages, domain=f"{org_id.hex[:8]}.test", lane=lane)
    await pool.execute(
        "UPDATE recipient SET site = $1 WHERE org_id = $2 AND lane = $3", SITE, org_id, lane
    )


async def claim(pool: asyncpg.Pool, batch: int = 100) -> claims.Claim:
    return await claims.claim_due_recipients(
        pool, owner="site-test/run", lease=300, batch=batch, lane_weights=LANE_WEIGHTS, ahead=AHEAD
    )


async def test_the_room_of_a_site_is_shared_evenly_between_its_orgs(pool: asyncpg.Pool) -> None:
    big, small = await ensure_org(pool, "big"), await ensure_org(pool, "small")
    await in_site_queue(pool, big, 5000)
    await in_site_queue(pool, small, 100)
    await budget(pool, tokens=RATE)
    claimed = await claim(pool)
    # The tokens now and those of the next AHEAD seconds, half to each org.
    room = int(RATE + AHEAD * RATE)
    assert len(claimed.rows) == room, len(claimed.rows)
    orgs = Counter(row.org_id for row in claimed.rows)
    assert abs(orgs[big] - orgs[small]) <= 1, orgs
    # Taken in the same transaction: the budget is in debt by what the claim took ahead.
    tokens = await pool.fetchval("SELECT tokens FROM budget WHERE key = $1", SITE)
    assert -AHEAD * RATE - 1 < tokens <= -AHEAD * RATE + 1, tokens
    # Each row waits for its token: none for the first RATE, then a token apart, and both orgs'
    # rows come early and late alike.
    delays = sorted(row.site_delay for row in claimed.rows)
    assert delays[int(RATE) - 1] == 0.0 and delays[-1] > 0, delays
    assert delays[-1] <= AHEAD + 1e-6, delays
    late = [row.org_id for row in claimed.rows if row.site_delay > 0]
    assert Counter(late)[small] >= 2 and Counter(late)[big] >= 2, Counter(late)
    # What one org leaves unused goes to the other: work-conserving.
    await pool.execute("UPDATE budget SET tokens = $1, refilled_at = clock_timestamp()", RATE)
    await pool.execute(
        "DELETE FROM recipient WHERE org_id = $1 AND status = 'queued' AND id IN"
        " (SELECT id FROM recipient WHERE org_id = $1 AND status = 'queued' LIMIT 70)",
        small,
    )
    again = Counter(row.org_id for row in (await claim(pool)).rows)
    assert again[small] == 5 and again[big] == room - 5, again
    assert all(row.site == SITE for row in claimed.rows)
    assert claimed.come_back is not None and claimed.come_back > 0


async def test_lane_weights_hold_inside_a_site(pool: asyncpg.Pool) -> None:
    org = await ensure_org(pool, "one")
    await in_site_queue(pool, org, 3000, lane="bulk")
    await in_site_queue(pool, org, 3000, lane="transactional")
    await budget(pool, tokens=RATE)
    claimed = await claim(pool)
    lanes = Counter(row.lane for row in claimed.rows)
    # Transactional weighs 10, bulk 1: at least its share of 50 (floor(50 * 10 / 11) = 45).
    assert lanes["transactional"] >= 45 and lanes["bulk"] >= 1, lanes


async def test_waiting_mail_is_not_touched_while_its_site_has_no_room(pool: asyncpg.Pool) -> None:
    org = await ensure_org(pool, "waiting")
    await in_site_queue(pool, org, 200)
    await budget(pool, tokens=0)
    # 4 a second, and the last claim took its tokens this far ahead (what refills while the test
    # runs, however loaded, is a small part of a token).
    await pool.execute(
        "UPDATE budget SET rate = 4, effective_rate = 4, burst = 4, tokens = $1,"
        " refilled_at = clock_timestamp()",
        -AHEAD * 4 - 3,
    )
    before = await pool.fetchval("SELECT max(updated_at) FROM recipient")
    claimed = await claim(pool)
    assert claimed.rows == []
    # When it should come back: the site has room for a token again in 4 tokens' time, 1 s.
    assert claimed.come_back is not None and 0.5 < claimed.come_back <= 1.0, claimed.come_back
    assert await pool.fetchval("SELECT max(updated_at) FROM recipient") == before
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'queued'") == 200


async def test_a_site_held_by_a_stated_retry_delay_is_not_claimed(pool: asyncpg.Pool) -> None:
    org = await ensure_org(pool, "held")
    await in_site_queue(pool, org, 50)
    await budget(pool, tokens=RATE, held_for=30)
    claimed = await claim(pool)
    assert claimed.rows == []
    assert claimed.come_back is not None and 25 < claimed.come_back <= 30, claimed.come_back


async def test_a_site_without_a_rate_gives_its_mail_back_to_the_general_queue(
    pool: asyncpg.Pool,
) -> None:
    org = await ensure_org(pool, "freed")
    await in_site_queue(pool, org, 30)
    await budget(pool, tokens=0)
    await pool.execute("UPDATE budget SET rate = 0, effective_rate = 0")
    assert (await claim(pool)).rows == []
    claimed = await claim(pool)
    assert len(claimed.rows) == 30 and all(row.site is None for row in claimed.rows)
    assert all(row.site_delay == 0 for row in claimed.rows)


async def test_a_backlog_joins_its_site_queue_in_one_write_per_row(pool: asyncpg.Pool) -> None:
    org = await ensure_org(pool, "joining")
    await bulk_queue(pool, org, messages=300, domain="shop.test")
    await bulk_queue(pool, org, messages=100, domain="elsewhere.test")
    moved = await leases.join_site_queues(
        pool, [(org, "transactional", "shop.test", SITE, "postponed: waiting")]
    )
    assert moved == 300
    rows = await pool.fetch("SELECT domain, site, count(*) FROM recipient GROUP BY 1, 2 ORDER BY 1")
    assert [tuple(r) for r in rows] == [("elsewhere.test", None, 100), ("shop.test", SITE, 300)]


async def test_a_suspended_site_is_not_claimed_until_it_is_resumed(pool: asyncpg.Pool) -> None:
    org = await ensure_org(pool, "suspended")
    await in_site_queue(pool, org, 10)
    await budget(pool, tokens=RATE)
    async with pool.acquire() as conn:
        await suspensions.suspend(conn, SITE, reason="provider incident", seconds=None)
        claimed = await claim(pool)
        assert claimed.rows == [] and claimed.come_back == 1.0
        assert await suspensions.resume(conn, SITE)
        assert not await suspensions.resume(conn, SITE)
    assert len((await claim(pool)).rows) == 10


async def test_a_suspended_org_or_lane_is_passed_over_by_both_claims(pool: asyncpg.Pool) -> None:
    held, free = await ensure_org(pool, "held"), await ensure_org(pool, "free")
    await in_site_queue(pool, held, 10)
    await bulk_queue(pool, held, messages=10, domain="general.test")
    await bulk_queue(pool, free, messages=10, domain="general.test", lane="bulk")
    await budget(pool, tokens=RATE)
    async with pool.acquire() as conn:
        await suspensions.suspend(conn, f"org:{held}", reason="review", seconds=None)
        assert {row.org_id for row in (await claim(pool)).rows} == {free}
        await suspensions.suspend(conn, "lane:transactional", reason="drain", seconds=2)
        await suspensions.resume(conn, f"org:{held}")
        # The lane's suspension ends by itself.
        assert (await claim(pool)).rows == []
        await asyncio.sleep(2.1)
    assert len((await claim(pool)).rows) == 20


async def test_deferred_mail_waits_in_the_retry_queue_and_is_woken_when_due(
    pool: asyncpg.Pool,
) -> None:
    org = await ensure_org(pool, "retrying")
    await bulk_queue(pool, org, messages=5, domain="retry.test")
    # As the record leaves a deferred recipient: in the retry queue until its next attempt.
    await pool.execute(
        "UPDATE recipient SET site = 'later', attempts = 1,"
        " next_attempt_at = now() + interval '2 seconds'"
    )
    assert (await claim(pool)).rows == []
    await asyncio.sleep(2.1)
    assert (await claim(pool)).rows == []  # this claim wakes them; the next one takes them
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE site IS NULL") == 5
    claimed = await claim(pool)
    assert len(claimed.rows) == 5 and all(row.site is None for row in claimed.rows)


async def test_a_held_site_without_a_rate_keeps_its_queue_until_the_delay_ends(
    pool: asyncpg.Pool,
) -> None:
    # A budget of sessions only (or one whose backoff ended) with a stated retry delay: its
    # queue is held, not given back to the general claim to come straight back.
    org = await ensure_org(pool, "held-sessions")
    await in_site_queue(pool, org, 10)
    await budget(pool, tokens=0, held_for=30)
    await pool.execute("UPDATE budget SET rate = 0, effective_rate = 0, concurrency = 5")
    claimed = await claim(pool)
    assert claimed.rows == [] and claimed.come_back is not None and claimed.come_back > 25
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE site = $1", SITE) == 10


async def test_a_message_to_many_recipients_of_a_site_costs_one_token(
    pool: asyncpg.Pool,
) -> None:
    org = await ensure_org(pool, "list")
    await bulk_queue(pool, org, messages=1, recipients_per_message=30, domain="list.test")
    await pool.execute("UPDATE recipient SET site = $1", SITE)
    await budget(pool, tokens=2)
    # A rate so slow that what refills while the test runs does not count, however loaded.
    await pool.execute("UPDATE budget SET rate = 0.01, effective_rate = 0.01, burst = 5")
    claimed = await claim(pool)
    # All 30 in one claim and one delivery, for one token.
    assert len(claimed.rows) == 30 and {row.site_delay for row in claimed.rows} == {0.0}
    assert len(group_deliveries(claimed.rows)) == 1
    tokens = await pool.fetchval("SELECT tokens FROM budget WHERE key = $1", SITE)
    assert 1.0 <= tokens < 1.01, tokens  # 2, less one


async def test_the_site_claim_takes_no_more_of_an_org_than_the_engine_has_room_for(
    pool: asyncpg.Pool,
) -> None:
    """An org at its room gets nothing from a site queue, whose room goes to the others; one
    with room for 4 gets 4 in all, from the site queue and the general queue together."""
    full, small, other = [await ensure_org(pool, n) for n in ("full", "small", "other")]
    for org in (full, small, other):
        await in_site_queue(pool, org, 100)
    await bulk_queue(pool, small, messages=50, domain="general.test")
    await budget(pool, tokens=RATE)

    async def take(room: dict[uuid.UUID, int]) -> Counter[uuid.UUID]:
        claimed = await claims.claim_due_recipients(
            pool,
            owner="site-test/run",
            lease=300,
            batch=100,
            lane_weights=LANE_WEIGHTS,
            ahead=AHEAD,
            org_cap=1000,
            org_room=room,
        )
        return Counter(row.org_id for row in claimed.rows)

    got = await take({full: 0, small: 4})
    assert got[full] == 0 and got[small] == 4, got
    assert got[other] == int(RATE + AHEAD * RATE) - 4, got
