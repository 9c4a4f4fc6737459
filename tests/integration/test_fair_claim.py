"""The fair claim: due recipients shared between (org, lane) groups, on a real PostgreSQL.

Each group with due mail gets a share of the batch by its lane's weight (split evenly between the
orgs of a lane); what the shares leave unused fills the batch, so a lone backlog takes it whole.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import asyncpg

from pigeon_mta.model import ClaimedRow
from pigeon_mta.store import claims
from pigeon_mta.store.orgs import ensure_org
from tests.integration.queue_helpers import LANE_WEIGHTS, bulk_queue

OWNER = "fair-test/run"


async def claim_rows(pool: asyncpg.Pool, batch: int) -> list[ClaimedRow]:
    claimed = await claims.claim_due_recipients(
        pool, owner=OWNER, lease=300, batch=batch, lane_weights=LANE_WEIGHTS
    )
    return claimed.rows


def groups(rows: list[ClaimedRow]) -> Counter[tuple[uuid.UUID, str]]:
    return Counter((row.org_id, row.lane) for row in rows)


async def test_another_orgs_mail_is_claimed_first_round_behind_a_large_backlog(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    # The backlog is older than the other org's mail: a FIFO claim would hand out 100,000 first.
    await bulk_queue(pool, org_id, messages=100_000, age=600, domain="bulk.test")
    other = await ensure_org(pool, "app")
    await bulk_queue(pool, other, messages=3, domain="idle.test")
    await pool.execute("ANALYZE recipient")
    rows = await claim_rows(pool, 100)
    assert len(rows) == 100
    assert groups(rows) == {(other, "transactional"): 3, (org_id, "transactional"): 97}


async def test_one_orgs_transactional_lane_is_claimed_beside_its_bulk_backlog(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=10_000, age=600, lane="bulk")
    await bulk_queue(pool, org_id, messages=5, lane="transactional")
    rows = await claim_rows(pool, 50)
    assert groups(rows) == {(org_id, "transactional"): 5, (org_id, "bulk"): 45}


async def test_a_lone_backlog_gets_the_whole_batch(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=500, lane="bulk")
    assert len(await claim_rows(pool, 100)) == 100


async def test_lanes_share_the_batch_by_weight_and_orgs_share_a_lane_evenly(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    second = await ensure_org(pool, "second")
    third = await ensure_org(pool, "third")
    # transactional (weight 10): two orgs with backlogs; bulk (weight 1): one org's backlog.
    await bulk_queue(pool, org_id, messages=1000, lane="transactional")
    await bulk_queue(pool, second, messages=1000, lane="transactional")
    await bulk_queue(pool, third, messages=1000, lane="bulk")
    rows = await claim_rows(pool, 110)
    assert groups(rows) == {
        (org_id, "transactional"): 50,
        (second, "transactional"): 50,
        (third, "bulk"): 10,
    }


async def test_a_lane_the_settings_do_not_name_weighs_one(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=1000, lane="retired")
    await bulk_queue(pool, org_id, messages=1000, lane="bulk")
    rows = await claim_rows(pool, 100)
    assert groups(rows) == {(org_id, "retired"): 50, (org_id, "bulk"): 50}


async def test_groups_with_nothing_due_take_no_share(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    waiting = await ensure_org(pool, "waiting")
    await bulk_queue(pool, waiting, messages=1000, due_in=3600)
    await bulk_queue(pool, org_id, messages=1000, lane="bulk")
    rows = await claim_rows(pool, 100)
    assert groups(rows) == {(org_id, "bulk"): 100}


async def test_more_groups_than_the_batch_holds_get_one_each_until_all_are_served(
    pool: asyncpg.Pool,
) -> None:
    orgs = [await ensure_org(pool, f"org{i:03d}") for i in range(30)]
    for i, org in enumerate(orgs):
        # org000's mail has waited longest, org029's least.
        await bulk_queue(pool, org, messages=2, age=1000 - i)
    claims = [await claim_rows(pool, 20) for _ in range(3)]
    for rows in claims[:2]:
        assert len(rows) == 20
        assert len({row.org_id for row in rows}) == 20  # one each: no org takes two places
    everything = [row.recipient.id for rows in claims for row in rows]
    assert len(set(everything)) == 60


async def test_parallel_fair_claims_never_hand_out_a_row_twice(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    other = await ensure_org(pool, "app")
    await bulk_queue(pool, org_id, messages=2000, lane="bulk")
    await bulk_queue(pool, other, messages=500)
    claimed: list[uuid.UUID] = []

    async def claimer() -> None:
        while rows := await claim_rows(pool, 37):
            claimed.extend(row.recipient.id for row in rows)

    await asyncio.gather(*(claimer() for _ in range(6)))
    assert len(claimed) == 2500
    assert len(set(claimed)) == 2500


async def test_lane_weights_hold_with_more_orgs_in_a_lane_than_the_batch_has_places(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    # 500 bulk orgs (weight 1) with due mail, one transactional org (weight 10) with a backlog:
    # "one place each" would hand the bulk orgs every place; the weights give transactional
    # 10/11 of each claim.
    orgs = await pool.fetch(
        "INSERT INTO org (id, name) SELECT gen_random_uuid(), 'bulk' || n"
        " FROM generate_series(1, 500) AS n RETURNING id"
    )
    for row in orgs:
        await bulk_queue(pool, row["id"], messages=3, lane="bulk", age=600)
    await bulk_queue(pool, org_id, messages=5000, lane="transactional")
    await pool.execute("ANALYZE recipient")
    bulk_orgs: set[uuid.UUID] = set()
    for _ in range(10):
        rows = await claim_rows(pool, 100)
        assert len(rows) == 100
        mine = sum(1 for row in rows if row.org_id == org_id)
        assert mine >= 80, mine
        bulk_orgs.update(row.org_id for row in rows if row.org_id != org_id)
    # The bulk places go round at random, not to the oldest or lowest-numbered orgs.
    assert len(bulk_orgs) >= 60


async def test_the_leftover_goes_round_rather_than_to_the_lowest_org_id(pool: asyncpg.Pool) -> None:
    low = await ensure_org(pool, "low")
    high = await ensure_org(pool, "high")
    if low.int > high.int:
        low, high = high, low
    await bulk_queue(pool, low, messages=2000, lane="bulk")
    await bulk_queue(pool, high, messages=2000, lane="bulk")
    small = await ensure_org(pool, "small")
    await bulk_queue(pool, small, messages=2, lane="transactional")
    totals: Counter[uuid.UUID] = Counter()
    for _ in range(40):
        rows = await claim_rows(pool, 100)
        totals.update(row.org_id for row in rows)
        # Everything back, due again: each claim sees the same three groups.
        await pool.execute(
            "UPDATE recipient SET status = 'queued', attempts = 0 WHERE status = 'delivering'"
        )
    # The small org's 2 in every claim; each claim's leftover (89 places) goes to one backlog
    # or the other at random: ordered by org id, the lower one would take all 40 (and the higher
    # one about 180 in all).
    assert totals[small] == 80
    assert totals[low] > 600 and totals[high] > 600, totals


async def test_the_claim_takes_no_more_of_an_org_than_the_engine_has_room_for(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """An engine that holds 70 of an org's deliveries with a cap of 75 gets 5 more of it and the
    rest of the batch from the others; one at its cap gets none of it; an org it holds nothing
    of gets at most the cap, both lanes together."""
    other, third = await ensure_org(pool, "other"), await ensure_org(pool, "third")
    await bulk_queue(pool, org_id, messages=500, domain="big.test")
    await bulk_queue(pool, other, messages=500, domain="other.test")
    await bulk_queue(pool, third, messages=200, domain="third.test", lane="bulk")
    await bulk_queue(pool, third, messages=200, domain="third.test", lane="transactional")

    async def claim(room: dict[uuid.UUID, int]) -> Counter[uuid.UUID]:
        claimed = await claims.claim_due_recipients(
            pool,
            owner=OWNER,
            lease=300,
            batch=100,
            lane_weights=LANE_WEIGHTS,
            org_cap=75,
            org_room=room,
        )
        return Counter(row.org_id for row in claimed.rows)

    got = await claim({org_id: 5, other: 0})
    assert got[org_id] == 5 and got[other] == 0 and got[third] == 75, got
    got = await claim({org_id: 0, other: 0})
    assert got == Counter({third: 75}), got


async def test_an_org_at_its_room_leaves_the_batch_to_the_others_and_it_fills(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """An org with room for 3 more, due in two lanes, gets 3 in all; the other orgs fill the
    rest of the batch to the last place (what the org could not take is not left empty)."""
    others = [await ensure_org(pool, f"other-{n}") for n in range(3)]
    for lane in ("bulk", "transactional"):
        await bulk_queue(pool, org_id, messages=300, domain=f"{lane}.big.test", lane=lane)
    for n, other in enumerate(others):
        await bulk_queue(pool, other, messages=60, domain=f"o{n}.test", lane="bulk")
    for _ in range(5):
        claimed = await claims.claim_due_recipients(
            pool,
            owner=OWNER,
            lease=300,
            batch=100,
            lane_weights=LANE_WEIGHTS,
            org_cap=1000,
            org_room={org_id: 3},
        )
        got = Counter(row.org_id for row in claimed.rows)
        assert got[org_id] == 3 and len(claimed.rows) == 100, got
        await pool.execute("UPDATE recipient SET status = 'queued', lease_until = NULL")
