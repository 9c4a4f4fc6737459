"""The site controller where its inputs meet on a real PostgreSQL: a throttling reply after a
recovery step or under a reply rule's limit, holds beside an operator's suspensions, and reports
the database refused at first."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest

from pigeon_mta.config import Settings
from pigeon_mta.outbound.throttling import ThrottlingReports
from pigeon_mta.store import budgets, controls, suspensions
from pigeon_mta.store.controls import Limit, Throttling

KEY = "destination:site:mx.busy.test"
SHORT = "destination:site:mx.short.test"


def throttled(holder: str, rate: float, sessions: int) -> Throttling:
    return Throttling(KEY, holder, rate=rate, concurrency=sessions, reply="421 4.7.0 slow down")


async def budget(pool: asyncpg.Pool) -> asyncpg.Record:
    return await pool.fetchrow("SELECT * FROM budget WHERE key = $1", KEY)


async def test_a_throttling_reply_after_a_recovery_step_is_a_new_decrease(
    pool: asyncpg.Pool,
) -> None:
    """Throttled at 80/s (to 40) and one recovery step up (to 50, still in backoff), the site
    throttles us again from another engine: a new decrease from the 50 in force (to 25), not an
    addition to the first decrease's reports (80 + 50 halved: a raise to 65), although the
    recovery step just wrote the budget."""
    await controls.report_throttling(pool, [throttled("n1/r#1", 80, 12)], factor=0.5, hold=0.2)
    await asyncio.sleep(0.35)
    await budgets.budgets_in_force(pool, step=0.125, quiet=0.3)
    row = await budget(pool)
    stepped = row["effective_rate"]  # 50 after one quiet period, 60 after two on a slow host
    assert row["backoff"] and 40 < stepped < 80
    await controls.report_throttling(pool, [throttled("n2/r#1", stepped, 7)], factor=0.5, hold=0.2)
    row = await budget(pool)
    assert row["backoff"] and row["effective_rate"] == stepped / 2
    assert list(row["reporters"]) == ["n2/r#1"]


async def test_under_a_rules_limit_a_throttling_reply_never_raises_the_rate(
    pool: asyncpg.Pool,
) -> None:
    """Within one decrease's hold a second engine's report adds what it sent; but a rule's limit
    set meanwhile (2/s, 1 session) stands: the addition lowers, never raises."""
    await controls.report_throttling(pool, [throttled("n1/r#1", 80, 12)], factor=0.5, hold=5)
    await controls.limit_budgets(pool, [Limit(KEY, rate=2, sessions=1, seconds=5, reason="r")])
    await controls.report_throttling(pool, [throttled("n2/r#1", 40, 4)], factor=0.5, hold=5)
    row = await budget(pool)
    assert (row["effective_rate"], row["effective_concurrency"]) == (2, 1)


async def test_a_decrease_under_a_rules_limit_does_not_make_the_limit_the_target(
    pool: asyncpg.Pool,
) -> None:
    """A site capped at 80/s where it throttled us gets a rule's limit of 1/s, and a throttling
    reply while it lasts: when the limit ends it recovers to 80, not to 1. A site that never
    throttled us before ends unlimited."""
    await controls.report_throttling(pool, [throttled("n1/r#1", 80, 12)], factor=0.5, hold=0.1)
    await asyncio.sleep(0.35)
    await budgets.budgets_in_force(pool, step=1.0, quiet=0.3)
    other = "destination:site:mx.fresh.test"
    limits = [Limit(k, rate=1, sessions=1, seconds=2, reason="r") for k in (KEY, other)]
    await controls.limit_budgets(pool, limits)
    await controls.report_throttling(
        pool,
        [throttled("n1/r#1", 1, 1), Throttling(other, "n1/r#1", 1, 1, "421 4.7.0 slow down")],
        factor=0.5,
        hold=0.1,
    )
    row = await budget(pool)
    assert (row["recover_rate"], row["recover_concurrency"]) == (80, 12)
    # The limit's time (2 s), then a quiet period of 0.3 s: a step of the whole target.
    await asyncio.sleep(2.6)
    in_force = await budgets.budgets_in_force(pool, step=1.0, quiet=0.3)
    row = await budget(pool)
    assert (row["effective_rate"], row["effective_concurrency"]) == (80, 12)
    assert KEY in in_force.capped
    fresh = await pool.fetchrow("SELECT * FROM budget WHERE key = $1", other)
    assert not fresh["backoff"] and not fresh["capped"]
    assert (fresh["effective_rate"], fresh["effective_concurrency"]) == (0, 0)


async def test_a_hold_replaces_an_ended_suspension_but_never_one_until_resumed(
    pool: asyncpg.Pool,
) -> None:
    """A reply's hold (kind 'reply') takes over a key whose operator suspension has ended, does
    not touch an operator's in force, and never turns one that lasts until resumed into one that
    ends, whoever wrote it (a node of the release before wrote kind 'reply' rows so)."""
    ended, active, forever = (f"{KEY}|org:{n}" for n in ("ended", "active", "forever"))
    await pool.execute(
        """INSERT INTO suspension (key, until, reason, kind) VALUES
           ($1, now() - interval '1 minute', 'maintenance', 'operator'),
           ($2, now() + interval '1 hour', 'maintenance', 'operator'),
           ($3, NULL, 'blocked by hand', 'reply')""",
        ended,
        active,
        forever,
    )
    await suspensions.hold(pool, {k: (30.0, "try again in 30 s") for k in (ended, active, forever)})
    rows = {
        r["key"]: r
        for r in await pool.fetch(
            "SELECT key, kind, reason, until > now() + interval '20 seconds' AS later,"
            " until IS NULL AS open FROM suspension"
        )
    }
    assert (rows[ended]["kind"], rows[ended]["reason"], rows[ended]["later"]) == (
        "reply",
        "try again in 30 s",
        True,
    )
    assert (rows[active]["kind"], rows[active]["reason"]) == ("operator", "maintenance")
    assert rows[forever]["open"] and rows[forever]["reason"] == "blocked by hand"


async def test_reports_the_database_refused_are_kept_and_sent_again(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """The database refuses every write of a budget for a moment (a trigger): the hold reported
    in the same round is stored all the same, and the limit, kept, is stored once the database
    takes it again, for the time it has left. Two limits of one site before that are merged:
    the lower rate, the lower sessions, the later end."""
    reports = ThrottlingReports(Settings(), pool, "n1/r#1")
    hold = f"{KEY}|org:00000000-0000-0000-0000-000000000001"
    await pool.execute(
        """CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'budgets are read-only for a moment'; END $$;
           CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON budget
           FOR EACH ROW EXECUTE FUNCTION refuse()"""
    )
    try:
        with caplog.at_level(logging.WARNING, "pigeon_mta.outbound.throttling"):
            reports.limit(KEY, 5, 0, 60, "rule a")
            reports.hold(hold, 30, "try again in 30 s")
            for _ in range(200):
                if "will retry" in caplog.text:
                    break
                await asyncio.sleep(0.02)
            assert "cannot store reply rules' limits (will retry)" in caplog.text
            reports.limit(KEY, 0, 3, 600, "rule b")
            # One whose time ends during the outage is not stored late.
            reports.limit(SHORT, 1, 0, 0.3, "rule c")
            await asyncio.sleep(0.5)
        assert await pool.fetchval("SELECT count(*) FROM suspension WHERE key = $1", hold) == 1
        assert await pool.fetchval("SELECT count(*) FROM budget WHERE key = $1", KEY) == 0
    finally:
        await pool.execute("DROP TRIGGER refuse ON budget")
    row = None
    for _ in range(200):
        row = await budget(pool)
        if row is not None:
            break
        await asyncio.sleep(0.05)
    assert row is not None, "the kept limit was never stored"
    assert (row["effective_rate"], row["effective_concurrency"]) == (5, 3)
    remaining = await pool.fetchval(
        "SELECT extract(epoch FROM limited_until - now()) FROM budget WHERE key = $1", KEY
    )
    assert 500 < remaining <= 600
    assert await pool.fetchval("SELECT count(*) FROM budget WHERE key = $1", SHORT) == 0
    await reports.close()
