"""The budget statements on a real PostgreSQL: grants, leased slots, backoff and its recovery."""

from __future__ import annotations

import asyncio

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.model import Reply
from pigeon_mta.outbound.limits import DestinationPolicy
from pigeon_mta.outbound.throttling import ThrottlingReports
from pigeon_mta.store import budgets, controls
from pigeon_mta.store.budgets import GrantRequest
from pigeon_mta.store.controls import Throttling
from pigeon_mta.store.orgs import ensure_org
from tests.integration.queue_helpers import bulk_queue

KEY = "destination:pattern:dest.test"


def request(
    tokens: int = 0, slots: int = 0, *, rate: float = 10, concurrency: int = 3
) -> GrantRequest:
    return GrantRequest(KEY, rate, concurrency, max(1.0, rate), tokens, slots)


async def take(
    pool: asyncpg.Pool, holder: str, *requests: GrantRequest, lease: float = 60, quiet: float = 30
) -> dict[str, budgets.Grant]:
    """A grant round as an engine makes it, after the recovery it applies once a second."""
    await controls.recover_budgets(pool, step=0.5, quiet=quiet)
    return await budgets.take_grants(
        pool, requests, holder=holder, lease=lease, horizon=60, stale=30
    )


async def test_tokens_are_granted_up_to_the_burst_and_the_rest_is_booked_a_token_apart(
    pool: asyncpg.Pool,
) -> None:
    first = (await take(pool, "n1/r#1", request(tokens=25)))[KEY]
    assert first.tokens == 10  # a full bucket: one second of 10/s
    second = (await take(pool, "n2/r#1", request(tokens=5)))[KEY]
    assert second.tokens == 0
    # The first caller's 15 handed back are booked over 1.5 s; the second's come after them.
    gap = (second.booked_from - first.booked_from).total_seconds()
    assert 1.4 <= gap <= 1.7, gap


async def test_slots_hold_for_every_holder_together_and_lapse_with_their_lease(
    pool: asyncpg.Pool,
) -> None:
    assert (await take(pool, "n1/r#1", request(tokens=2, slots=2), lease=1))[KEY].held == 2
    assert (await take(pool, "n2/r#1", request(tokens=5, slots=5)))[KEY].slots == 1
    assert (await take(pool, "n2/r#1", request(tokens=1, slots=1)))[KEY].slots == 0
    await asyncio.sleep(1.2)  # n1 died: its lease runs out
    assert (await take(pool, "n2/r#1", request(tokens=1, slots=3)))[KEY].held == 3
    # Given back, they are free at once.
    assert await budgets.hold_slots(pool, {KEY: 0}, holder="n2/r#1", lease=60) == {}
    assert (await take(pool, "n1/r#2", request(tokens=1, slots=3)))[KEY].slots == 3


async def test_throttling_halves_the_budget_once_per_overload_and_it_recovers_in_steps(
    pool: asyncpg.Pool,
) -> None:
    await take(pool, "n1/r#1", request(tokens=1, slots=3))
    reply = "421 4.7.0 Try again later"
    report = Throttling(KEY, "n1/r#1", rate=10, concurrency=3, reply=reply)
    await controls.report_throttling(pool, [report], factor=0.5, hold=1.0)
    await controls.report_throttling(pool, [report], factor=0.5, hold=1.0)  # the same overload
    grant = (await take(pool, "n1/r#1", request(), quiet=0.3))[KEY]
    assert (grant.effective_rate, grant.effective_concurrency) == (5, 1)
    # The slots held beyond the lowered concurrency are taken back at the next renewal.
    assert await budgets.hold_slots(pool, {KEY: 3}, holder="n1/r#1", lease=60) == {KEY: 1}
    listed = {b.key: b for b in await budgets.list_budgets(pool)}[KEY]
    assert (
        listed.backoff
        and listed.last_reply == reply
        and (listed.rate, listed.concurrency)
        == (
            10,
            3,
        )
    )
    # Each quiet period adds back half of the configured values (step 0.5), then backoff ends.
    await asyncio.sleep(0.35)
    grant = (await take(pool, "n1/r#1", request(), quiet=0.3))[KEY]
    assert (grant.effective_rate, grant.effective_concurrency) == (10, 3)
    in_force = await budgets.budgets_in_force(pool, step=0.5, quiet=0.3)
    assert KEY not in in_force.backing_off


async def test_a_destination_without_limits_backs_off_from_what_the_cluster_was_sending(
    pool: asyncpg.Pool,
) -> None:
    """Two engines report throttling within one decrease's hold: it halves what both were
    sending together (80 + 40 a second, 12 + 4 sessions), not the first reporter's alone. A
    report of an engine already counted, and one after the decrease from another engine that
    was counted, change nothing."""
    key = "destination:mx:busy.test"
    first = Throttling(key, "n1/r#1", rate=80, concurrency=12, reply="421 try again later")
    second = Throttling(key, "n2/r#1", rate=40, concurrency=4, reply="421 try again later")
    await controls.report_throttling(pool, [first], factor=0.5, hold=1.0)
    await controls.report_throttling(pool, [second], factor=0.5, hold=1.0)
    await controls.report_throttling(pool, [first], factor=0.5, hold=1.0)
    in_force = await budgets.budgets_in_force(pool, step=0.1, quiet=30)
    assert key in in_force.backing_off
    grant = (await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=3, slots=3)))[key]
    assert (grant.effective_rate, grant.effective_concurrency) == (60, 8)
    # The next overload (after the hold) halves the rate in force, whoever reports it.
    await asyncio.sleep(1.05)
    await controls.report_throttling(pool, [second], factor=0.5, hold=1.0)
    grant = (await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=0)))[key]
    assert (grant.effective_rate, grant.effective_concurrency) == (30, 4)


async def test_a_starting_node_frees_the_slots_its_earlier_runs_held(pool: asyncpg.Pool) -> None:
    for holder in ("node-a/old#10", "node-a/new#11", "node-ab/x#12"):
        await take(pool, holder, request(tokens=1, slots=1))
    assert await budgets.free_slots_of_gone_runs(pool, "node-a", "node-a/new") == 1
    holders = await pool.fetch("SELECT holder FROM budget_slot ORDER BY holder")
    assert [r["holder"] for r in holders] == ["node-a/new#11", "node-ab/x#12"]


async def test_callers_that_queue_for_the_row_never_get_more_than_the_rate(
    db_url: str, pool: asyncpg.Pool
) -> None:
    """16 callers on their own connections take tokens of one budget (20/s, a burst of 1) as
    fast as they can for 3 s. Each waits for the row lock; its grant must be counted from when it
    got the lock, not from when its statement began: counted from the start, a caller that began
    before the one ahead of it saw time go backwards, and the next one was granted that stretch
    twice (1.95x and 5.5x the rate with 8 and 16 callers)."""
    rate, seconds = 20.0, 3.0
    connections = [await asyncpg.connect(db_url) for _ in range(16)]
    granted = [0] * len(connections)
    grants: list[int] = []
    loop = asyncio.get_running_loop()

    async def caller(i: int, conn: asyncpg.Connection, until: float) -> None:
        while loop.time() < until:
            grant = await budgets.take_grants(
                conn,
                [GrantRequest(KEY, rate, 0, 1.0, 1, 0)],
                holder=f"n{i}/r#1",
                lease=60,
                horizon=60,
                stale=30,
            )
            granted[i] += grant[KEY].tokens
            grants.append(grant[KEY].tokens)

    try:
        await take(pool, "warm/r#1", GrantRequest(KEY, rate, 0, 1.0, 1, 0))  # the row exists
        started = await pool.fetchval("SELECT clock_timestamp()")
        until = loop.time() + seconds
        await asyncio.gather(*(caller(i, c, until) for i, c in enumerate(connections)))
        ended = await pool.fetchval("SELECT clock_timestamp()")
    finally:
        for conn in connections:
            await conn.close()
    elapsed = (ended - started).total_seconds()
    # The bucket allows its rate over the time and one burst; a token's worth of rounding more.
    assert min(grants) >= 0, sorted(grants)[:5]  # never a negative grant
    assert sum(granted) <= rate * elapsed + 2, (sum(granted), elapsed)
    assert await pool.fetchval("SELECT tokens >= 0 FROM budget WHERE key = $1", KEY)


async def test_the_slots_of_a_run_that_is_gone_are_free_before_their_lease_ends(
    pool: asyncpg.Pool,
) -> None:
    """node-a's run r1 (its process 101, as engines name themselves) holds the destination's
    only slot under a 5-minute lease. While r1's
    heartbeat is fresh, nobody else gets a slot; once it is older than the staleness (a node
    killed outright), or once another run took the name, the slot is free at the next take."""
    await pool.execute("INSERT INTO node (name, run_id, host, pid) VALUES ('node-a', 'r1', 'h', 1)")
    assert (await take(pool, "node-a/r1#101", request(slots=1, concurrency=1), lease=300))[
        KEY
    ].slots == 1
    assert (await take(pool, "node-b/r9#202", request(slots=1, concurrency=1)))[KEY].slots == 0
    await pool.execute("UPDATE node SET heartbeat_at = now() - interval '31 seconds'")
    assert (await take(pool, "node-b/r9#202", request(slots=1, concurrency=1)))[KEY].slots == 1
    assert (
        await pool.fetchval("SELECT count(*) FROM budget_slot WHERE holder = 'node-a/r1#101'") == 0
    )
    # A new run of node-a (the name taken over) does not keep r1's slot either.
    await pool.execute("DELETE FROM budget_slot")
    await pool.execute("UPDATE node SET heartbeat_at = now()")
    assert (await take(pool, "node-a/r1#101", request(slots=1, concurrency=1), lease=300))[
        KEY
    ].slots == 1
    await pool.execute("UPDATE node SET run_id = 'r2'")
    assert (await take(pool, "node-b/r9#202", request(slots=1, concurrency=1)))[KEY].slots == 1


async def test_a_destination_without_limits_recovers_to_what_it_took_not_to_unlimited(
    pool: asyncpg.Pool,
) -> None:
    """After a throttling reply at 80/s and 12 sessions, recovery stops there: a server that
    throttled at that rate is not sent more again (a 421 sawtooth), even though nothing is
    configured."""
    key = "destination:site:mx.busy.test"
    report = Throttling(key, "n1/r#1", rate=80, concurrency=12, reply="421 4.7.0 slow down")
    await controls.report_throttling(pool, [report], factor=0.5, hold=1.0)
    await asyncio.sleep(0.35)
    # Recovered in steps of half (step 0.5 each quiet period of 0.3 s): 40 -> 80, 6 -> 12.
    grant = await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=1), quiet=0.3)
    assert (grant[key].effective_rate, grant[key].effective_concurrency) == (80, 12)
    in_force = await budgets.budgets_in_force(pool, step=0.5, quiet=0.3)
    assert key not in in_force.backing_off and key in in_force.capped
    # It stays there: the next grants keep the cap the engines now ask for.
    await asyncio.sleep(0.35)
    grant = await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=1), quiet=0.3)
    assert (grant[key].effective_rate, grant[key].effective_concurrency) == (80, 12)
    listed = {b.key: b for b in await budgets.list_budgets(pool)}[key]
    assert not listed.backoff and listed.effective_rate == 80


async def test_a_capped_destination_probes_upward_while_mail_waits_for_it(
    pool: asyncpg.Pool,
) -> None:
    """Capped where it throttled us (80/s, 12 sessions), a site whose mail waits in its queue
    tries a little more each two quiet periods without a throttling reply (step 0.5: +40/s and
    one session), so a server that raised its limit is found again; one with nothing waiting
    stays where it is."""
    key = "destination:site:mx.busy.test"
    report = Throttling(key, "n1/r#1", rate=80, concurrency=12, reply="421 4.7.0 slow down")
    await controls.report_throttling(pool, [report], factor=0.5, hold=1.0)
    await asyncio.sleep(0.35)
    in_force = await budgets.budgets_in_force(pool, step=0.5, quiet=0.3)
    assert key in in_force.capped and in_force.capped
    await asyncio.sleep(0.65)
    grant = await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=0), quiet=0.3)
    assert (grant[key].effective_rate, grant[key].effective_concurrency) == (80, 12)
    org = await ensure_org(pool, "probing")
    await bulk_queue(pool, org, messages=3, domain="busy.test", lane="bulk")
    await pool.execute("UPDATE recipient SET site = $1", key)
    grant = await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=0), quiet=0.3)
    assert (grant[key].effective_rate, grant[key].effective_concurrency) == (120, 13)
    # Not again before two more quiet periods.
    grant = await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=0), quiet=0.3)
    assert grant[key].effective_rate == 120
    # A throttling reply there decreases from the probed rate, and recovery stops at it.
    await controls.report_throttling(pool, [report], factor=0.5, hold=1.0)
    listed = {b.key: b for b in await budgets.list_budgets(pool)}[key]
    assert listed.backoff and listed.effective_rate == 60
    assert await pool.fetchval("SELECT recover_rate FROM budget WHERE key = $1", key) == 120


async def test_a_rules_limit_holds_for_its_time_then_the_site_is_as_it_was(
    pool: asyncpg.Pool,
) -> None:
    """A reply rule's `rate` action on a site that never throttled us: at most that rate for the
    cluster, in backoff, until its time ends; a quiet period later it is unlimited again, not
    capped at the rule's rate."""
    key = "destination:site:mx.rules.test"
    await controls.limit_budgets(
        pool, [controls.Limit(key, rate=5, sessions=2, seconds=2, reason="rule x")]
    )
    grant = await take(pool, "n1/r#1", GrantRequest(key, 0, 0, 1, tokens=1, slots=0), quiet=0.3)
    assert (grant[key].effective_rate, grant[key].effective_concurrency) == (5, 2)
    in_force = await budgets.budgets_in_force(pool, step=0.5, quiet=0.3)
    assert key in in_force.backing_off
    await asyncio.sleep(0.8)  # within its time (2 s, a quiet period of 0.3 s after): limited
    in_force = await budgets.budgets_in_force(pool, step=0.5, quiet=0.3)
    assert key in in_force.backing_off
    await asyncio.sleep(1.8)
    in_force = await budgets.budgets_in_force(pool, step=0.5, quiet=0.3)
    assert key not in in_force.backing_off and key not in in_force.capped
    row = await pool.fetchrow("SELECT * FROM budget WHERE key = $1", key)
    assert (row["effective_rate"], row["effective_concurrency"]) == (0, 0)


async def test_a_hostile_reply_is_stored_plain_in_the_hold_and_the_budget(
    pool: asyncpg.Pool,
) -> None:
    """A reply with NUL, undecodable bytes and 20 KB of text that states a retry delay: the hold
    and the budget's last reply are written, plain and bounded, and the throttling is counted."""
    reports = ThrottlingReports(Settings(), pool, "n1/r#1")
    reply = Reply(421, "4.7.0", "try again in 5 seconds \x00 \udcff " + "x" * 20000)
    key = "destination:site:mx.hostile.test|org:00000000-0000-0000-0000-000000000001"
    policy = DestinationPolicy("site:mx.hostile.test", "opportunistic", 10, 0.0, 0, 0, 100)
    reports.throttled(policy, reply)
    reports.hold(key, 5, f"the destination asked to retry in 5 s ({reply})")
    for _ in range(100):
        if await pool.fetchval("SELECT count(*) FROM suspension WHERE key = $1", key):
            break
        await asyncio.sleep(0.02)
    reason = await pool.fetchval("SELECT reason FROM suspension WHERE key = $1", key)
    assert reason.startswith("the destination asked to retry in 5 s (421 4.7.0 try again")
    assert len(reason) <= 500 and "\x00" not in reason and reason.isascii()
    last = await pool.fetchval(
        "SELECT last_reply FROM budget WHERE key = 'destination:site:mx.hostile.test'"
    )
    assert last is not None and len(last) <= 500 and last.isascii()
    await reports.close()
