"""`pigeon-mta queue …`: summary, list, show, and bulk actions that touch what their dry run counted."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from pigeon_mta.model import AttemptResult, Outcome, Reply
from pigeon_mta.store.orgs import ensure_org
from tests.conftest import run_pigeon
from tests.e2e.shared import pigeon_json as pigeon
from tests.integration.queue_helpers import bulk_queue, record_attempts

HOUR = 3600


async def deferred(
    pool: asyncpg.Pool, org_id: uuid.UUID, *, messages: int, domain: str, age: float
) -> None:
    """Recipients that were tried and are waiting for their next attempt, an hour from now."""
    await bulk_queue(pool, org_id, messages=messages, domain=domain, age=age, due_in=HOUR)
    await pool.execute(
        """UPDATE recipient SET attempts = 2, last_code = 451, last_enhanced_code = '4.7.1',
                  last_response = 'try again later (' || domain || ')'
           WHERE attempts = 0 AND status = 'queued'"""
    )


async def fill(pool: asyncpg.Pool, acme: uuid.UUID) -> uuid.UUID:
    other = await ensure_org(pool, "other")
    await deferred(pool, acme, messages=30, domain="example.net", age=2 * HOUR)
    await deferred(pool, acme, messages=10, domain="example.net", age=60)
    await deferred(pool, acme, messages=20, domain="other.example", age=2 * HOUR)
    await deferred(pool, other, messages=15, domain="example.net", age=2 * HOUR)
    for status, count in (("bounced", 5), ("expired", 4), ("delivering", 3), ("delivered", 50)):
        await bulk_queue(
            pool, acme, messages=count, domain="example.net", age=2 * HOUR, status=status
        )
    await pool.execute("UPDATE recipient SET attempts = 1 WHERE status <> 'queued'")
    await bulk_queue(pool, acme, messages=7, domain="fresh.example")  # never tried yet
    return other


async def snapshot(pool: asyncpg.Pool) -> dict[uuid.UUID, tuple[Any, ...]]:
    rows = await pool.fetch("SELECT id, status, next_attempt_at, created_at FROM recipient")
    return {r["id"]: (r["status"], r["next_attempt_at"], r["created_at"]) for r in rows}


def changed(before: dict[uuid.UUID, Any], after: dict[uuid.UUID, Any]) -> set[uuid.UUID]:
    return {k for k in before if before[k] != after[k]}


async def test_retry_by_filter_touches_exactly_what_the_dry_run_counted(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await fill(pool, org_id)
    flt = ["--domain", "example.net", "--org", "acme", "--older-than", "1h"]
    dry = pigeon(db_url, "queue", "retry", *flt, "--dry-run")
    assert dry == {"action": "retry", "dry_run": True, "count": 30, "delivering_left_alone": 3}
    before = await snapshot(pool)
    assert changed(before, await snapshot(pool)) == set()  # the dry run changed nothing

    done = pigeon(db_url, "queue", "retry", *flt)
    after = await snapshot(pool)
    touched = changed(before, after)
    assert done["count"] == dry["count"] == len(touched)
    expected = {
        r["id"]
        for r in await pool.fetch(
            """SELECT r.id FROM recipient r JOIN org o ON o.id = r.org_id
               WHERE o.name = 'acme' AND r.domain = 'example.net' AND r.attempts = 2
                 AND r.created_at < now() - interval '1 hour'"""
        )
    }
    assert touched == expected
    assert {after[i][0] for i in touched} == {"queued"}
    due = await pool.fetchval(
        "SELECT count(*) FROM recipient WHERE id = ANY($1) AND next_attempt_at <= now()",
        list(touched),
    )
    assert due == 30

    # Bounced and expired are retried only when asked for, and get a fresh max_age.
    dry = pigeon(
        db_url, "queue", "retry", "--status", "bounced", "--status", "expired", "--dry-run"
    )
    before = await snapshot(pool)
    done = pigeon(db_url, "queue", "retry", "--status", "bounced", "--status", "expired")
    touched = changed(before, await snapshot(pool))
    assert dry["count"] == done["count"] == len(touched) == 9
    fresh = await pool.fetchval(
        """SELECT count(*) FROM recipient WHERE id = ANY($1) AND status = 'queued'
             AND created_at > now() - interval '1 minute'""",
        list(touched),
    )
    assert fresh == 9


async def test_cancel_by_filter_touches_exactly_what_the_dry_run_counted(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await fill(pool, org_id)
    dry = pigeon(db_url, "queue", "cancel", "--domain", "example.net", "--dry-run")
    # Waiting at example.net in both orgs: 30 + 10 + 15; the 3 being delivered are left alone.
    assert (dry["count"], dry["delivering_left_alone"]) == (55, 3)
    before = await snapshot(pool)
    done = pigeon(db_url, "queue", "cancel", "--domain", "example.net")
    after = await snapshot(pool)
    touched = changed(before, after)
    assert done["count"] == dry["count"] == len(touched)
    assert {after[i][0] for i in touched} == {"cancelled"}
    assert {before[i][0] for i in touched} == {"queued"}

    # Scoped to an org, by id: ids of another org's mail are not found in it.
    other_ids = [
        r["message_id"]
        for r in await pool.fetch(
            "SELECT message_id FROM recipient WHERE domain = 'other.example' LIMIT 3"
        )
    ]
    refused = run_pigeon(
        "queue", "cancel", *map(str, other_ids), "--org", "other", "--dry-run",
        env={"PIGEON_DATABASE_URL": db_url},
    )  # fmt: skip
    assert refused.returncode == 1 and "no message or recipient in org 'other'" in refused.stderr
    done = pigeon(db_url, "queue", "cancel", *map(str, other_ids), "--org", "acme")
    assert done["count"] == 3


async def test_bulk_actions_want_a_target_and_valid_input(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    env = {"PIGEON_DATABASE_URL": db_url}
    for args, words in (
        (["queue", "retry"], "say which recipients"),
        (["queue", "cancel", "--org", "nope"], "no org named 'nope'"),
        (["queue", "retry", "not-an-id"], "not a queue id"),
        (["queue", "retry", "--older-than", "ages"], "--older-than"),
        (["queue", "show", str(uuid.uuid4())], "no message or recipient"),
    ):
        result = run_pigeon(*args, env=env)
        assert result.returncode == 1 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    text = run_pigeon("queue", "cancel", "--all", "--dry-run", env=env)
    assert text.returncode == 0 and "would cancel 0 recipient(s)" in text.stdout


async def test_retry_or_cancel_of_an_unknown_id_says_so_and_changes_nothing(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await deferred(pool, org_id, messages=1, domain="example.net", age=60)
    known = str(await pool.fetchval("SELECT message_id FROM recipient"))
    before = await snapshot(pool)
    ghost = str(uuid.uuid4())
    for action, done in (("retry", "retried"), ("cancel", "cancelled")):
        result = run_pigeon("queue", action, known, ghost, env={"PIGEON_DATABASE_URL": db_url})
        assert result.returncode == 1, result.stdout
        assert f"no message or recipient has the id {ghost}; nothing was {done}" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert changed(before, await snapshot(pool)) == set()
    assert await pool.fetchval("SELECT count(*) FROM attempt") == 0


async def test_summary_list_and_show(db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await fill(pool, org_id)
    summary = pigeon(db_url, "queue")
    assert summary["counts"]["queued"] == 30 + 10 + 20 + 15 + 7
    assert summary["counts"]["delivering"] == 3
    assert summary["counts"]["delivered"] == 50 and summary["counts"]["bounced"] == 5
    assert summary["estimated"] == []  # a small table is counted exactly
    assert (summary["deferred"], summary["due"]) == (75, 7)
    top = summary["top_deferred_destinations"]
    assert [(d["domain"], d["deferred"]) for d in top] == [
        ("example.net", 55),
        ("other.example", 20),
    ]
    assert top[1]["latest_reply"] == "451 4.7.1 try again later (other.example)"

    table = run_pigeon("queue", env={"PIGEON_DATABASE_URL": db_url})
    assert table.returncode == 0, table.stderr
    assert "other.example" in table.stdout and "oldest due recipient has waited" in table.stdout

    # A queued row that was tried before is shown as what --status deferred selects.
    listed = pigeon(db_url, "queue", "list", "--status", "deferred", "--domain", "other.example")
    assert len(listed) == 20 and {r["status"] for r in listed} == {"deferred"}
    live = pigeon(db_url, "queue", "list", "--domain", "fresh.example")
    assert len(live) == 7 and {r["status"] for r in live} == {"queued"}
    table = run_pigeon("queue", "list", "--org", "other", env={"PIGEON_DATABASE_URL": db_url})
    assert [line.split()[2] for line in table.stdout.splitlines()[1:]] == ["deferred"] * 15
    assert pigeon(db_url, "queue", "list", "--org", "other", "--limit", "5").__len__() == 5
    assert len(pigeon(db_url, "queue", "list", "--status", "delivered")) == 50
    assert len(pigeon(db_url, "queue", "list")) == 85  # the live queue: queued + delivering

    rid = listed[0]["id"]
    await pool.execute(
        """INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at,
                                outcome, code, enhanced_code, response, category)
           SELECT gen_random_uuid(), id, message_id, org_id, 1, now(), 'deferred', 451, '4.7.1',
                  'later', 'greylisted' FROM recipient WHERE id = $1""",
        uuid.UUID(rid),
    )
    by_recipient = pigeon(db_url, "queue", "show", rid)
    assert [r["id"] for r in by_recipient["recipients"]] == [rid]
    assert [a["category"] for a in by_recipient["attempts"]] == ["greylisted"]
    by_message = pigeon(db_url, "queue", "show", listed[0]["queue_id"])
    assert by_message["queue_id"] == listed[0]["queue_id"]
    assert by_message["sender"] == "sender@example.com" and by_message["org"] == "acme"
    text = run_pigeon("queue", "show", rid, env={"PIGEON_DATABASE_URL": db_url})
    assert text.returncode == 0 and "greylisted" in text.stdout


async def test_operator_actions_are_in_the_message_log(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """`queue cancel` and `queue retry` leave a line in the attempt log, so `pigeon-mta log`
    says why a recipient stopped, or was tried again early; untouched recipients get none."""
    await deferred(pool, org_id, messages=2, domain="example.net", age=60)
    first, second = [
        r["message_id"]
        for r in await pool.fetch("SELECT message_id FROM recipient ORDER BY message_id")
    ]
    assert pigeon(db_url, "queue", "cancel", str(first))["count"] == 1
    assert pigeon(db_url, "queue", "retry", str(second))["count"] == 1

    def events(queue_id: uuid.UUID) -> list[dict[str, Any]]:
        result = run_pigeon("log", str(queue_id), "--json", env={"PIGEON_DATABASE_URL": db_url})
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    cancelled = [e for e in events(first) if e["type"] != "Reception"]
    assert [e["type"] for e in cancelled] == ["Cancelled"]
    assert "cancelled by an operator" in cancelled[0]["response"]
    retried = [e for e in events(second) if e["type"] != "Reception"]
    assert [e["type"] for e in retried] == ["Retried"]
    assert "made due now by an operator" in retried[0]["response"]
    # A second cancel finds nothing to cancel and logs nothing more.
    assert pigeon(db_url, "queue", "cancel", str(first))["count"] == 0
    assert await pool.fetchval("SELECT count(*) FROM attempt") == 2


async def test_cancel_and_retry_take_a_recipient_whose_lease_ran_out(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A recipient left `delivering` by a worker that died or could not record (no server runs
    here) is nobody's: cancel and retry take it, by id and by filter; one under a live lease is
    left alone and reported."""
    await bulk_queue(pool, org_id, messages=3, domain="example.net", status="delivering")
    stuck, other, live = [
        r["message_id"]
        for r in await pool.fetch("SELECT message_id FROM recipient ORDER BY message_id")
    ]
    await pool.execute(
        "UPDATE recipient SET attempts = 1, lease_until = now() - interval '1 minute' "
        "WHERE message_id = ANY ($1::uuid[])",
        [stuck, other],
    )
    cancelled = pigeon(db_url, "queue", "cancel", str(stuck), str(live))
    assert cancelled["count"] == 1 and cancelled["delivering_left_alone"] == 1
    retried = pigeon(db_url, "queue", "retry", "--domain", "example.net")
    assert retried["count"] == 1 and retried["delivering_left_alone"] == 1
    rows = {
        r["message_id"]: r
        for r in await pool.fetch("SELECT message_id, status, lease_until FROM recipient")
    }
    assert rows[stuck]["status"] == "cancelled" and rows[stuck]["lease_until"] is None
    assert rows[other]["status"] == "queued" and rows[other]["lease_until"] is None
    assert rows[live]["status"] == "delivering"
    # The claim that left them is fenced out: its outcome, recorded late, moves nothing.

    rid = await pool.fetchval("SELECT id FROM recipient WHERE message_id = $1", stuck)
    late = AttemptResult(
        recipient_id=rid,
        queue_id=stuck,
        org_id=org_id,
        attempt=1,
        outcome=Outcome.DELIVERED,
        reply=Reply(250, "2.0.0", "ok"),
        started_at=datetime.now(UTC),
    )
    assert await record_attempts(pool, [late]) == set()
    assert await pool.fetchval("SELECT status FROM recipient WHERE id = $1", rid) == "cancelled"
