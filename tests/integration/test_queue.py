"""The queue against a real PostgreSQL: atomic enqueue, disjoint claims, leases, records, expiry."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from pigeon_mta.config import Settings
from pigeon_mta.ids import id_floor
from pigeon_mta.model import AttemptResult, Envelope, Outcome, Reply
from pigeon_mta.store import claims, leases, outcomes, queue, upkeep
from pigeon_mta.store.connect import server_settings
from tests.integration.queue_helpers import bulk_queue, claim, record_attempts, results_for

OWNER = "node-a"


def envelope(
    org_id: uuid.UUID, *recipients: str, body: bytes = b"Subject: hi\r\n\r\nhello\r\n"
) -> Envelope:
    return Envelope(
        org_id=org_id,
        sender="alice@example.com",
        recipients=recipients or ("bob@example.net",),
        body=body,
        listener="relay",
        header_message_id="abc@example.com",
        client_ip="127.0.0.1",
    )


async def count(pool: asyncpg.Pool, table: str) -> int:
    return int(await pool.fetchval(f"SELECT count(*) FROM {table}"))


async def test_enqueue_writes_message_and_every_recipient(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    qid = await queue.enqueue(
        pool, envelope(org_id, "a@one.example", "b@Two.Example", "c@one.example")
    )
    assert qid.version == 7
    msg = await pool.fetchrow("SELECT * FROM message WHERE id = $1", qid)
    assert msg["sender"] == "alice@example.com" and msg["size"] == len(msg["body"])
    rows = await pool.fetch(
        "SELECT address, status, attempts FROM recipient WHERE message_id = $1 ORDER BY address",
        qid,
    )
    assert [r["address"] for r in rows] == ["a@one.example", "b@Two.Example", "c@one.example"]
    assert all(r["status"] == "queued" and r["attempts"] == 0 for r in rows)
    domains = await pool.fetch(
        "SELECT domain FROM recipient WHERE message_id = $1 ORDER BY address", qid
    )
    assert [d["domain"] for d in domains] == ["one.example", "two.example", "one.example"]


@pytest.mark.parametrize("messages", [1, 3], ids=["one message", "a batch"])
async def test_enqueue_is_atomic_when_a_recipient_insert_fails(
    pool: asyncpg.Pool, org_id: uuid.UUID, messages: int
) -> None:
    # A trigger makes the recipient insert fail after the message rows were written in the same
    # statement: none may remain. (A lone message and a batch have statements of their own.)
    await pool.execute(
        """CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN IF NEW.address = 'boom@example.net' THEN RAISE EXCEPTION 'refused'; END IF;
                 RETURN NEW; END $$;
           CREATE TRIGGER refuse_boom BEFORE INSERT ON recipient
           FOR EACH ROW EXECUTE FUNCTION refuse_boom();"""
    )
    batch = [(uuid.uuid4(), envelope(org_id, "ok@example.net")) for _ in range(messages - 1)]
    batch.append((uuid.uuid4(), envelope(org_id, "ok@example.net", "boom@example.net")))
    with pytest.raises(asyncpg.RaiseError):
        await queue.enqueue_many(pool, batch)
    assert await count(pool, "message") == 0
    assert await count(pool, "recipient") == 0


@pytest.mark.parametrize("batch", [False, True], ids=["one message", "a batch"])
async def test_an_idn_recipient_is_grouped_under_the_name_it_is_routed_by(
    pool: asyncpg.Pool, org_id: uuid.UUID, batch: bool
) -> None:
    """The grouping key of a recipient (its domain: the site queues, the claim, `queue`) is the
    A-label spelling that routing and the destination limits use (domains.routing_domain)."""
    message = envelope(org_id, "anna@Bücher.Example", "bob@xn--bcher-kva.example")
    if batch:
        await queue.enqueue_many(pool, [(uuid.uuid4(), message), (uuid.uuid4(), envelope(org_id))])
    else:
        await queue.enqueue(pool, message)
    rows = await pool.fetch(
        "SELECT address, domain FROM recipient WHERE address <> 'bob@example.net' ORDER BY address"
    )
    assert [(r["address"], r["domain"]) for r in rows] == [
        ("anna@Bücher.Example", "xn--bcher-kva.example"),
        ("bob@xn--bcher-kva.example", "xn--bcher-kva.example"),
    ]


async def test_a_lone_message_and_a_batch_write_the_same_rows(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A lone message has a statement of its own; it must write what the batch statement does."""
    credential = await pool.fetchval(
        "INSERT INTO credential (id, org_id, username, password_hash) "
        "VALUES (gen_random_uuid(), $1, 'app', 'x') RETURNING id",
        org_id,
    )
    full = dataclasses.replace(
        envelope(org_id, "a@one.example", "B@Two.Example"),
        client_helo="client.test",
        credential_id=credential,
        auth_user="app",
    )
    alone = await queue.enqueue(pool, full, notify=False)
    batched = uuid.uuid4()
    await queue.enqueue_many(pool, [(batched, full), (uuid.uuid4(), envelope(org_id))])

    def comparable(row: asyncpg.Record) -> dict[str, object]:
        skip = {"id", "message_id", "received_at", "created_at", "updated_at", "next_attempt_at"}
        return {k: v for k, v in dict(row).items() if k not in skip}

    messages = {
        qid: comparable(await pool.fetchrow("SELECT * FROM message WHERE id = $1", qid))
        for qid in (alone, batched)
    }
    assert messages[alone] == messages[batched]
    assert messages[alone]["client_helo"] == "client.test" and messages[alone]["auth_user"] == "app"
    recipients = {
        qid: [
            comparable(r)
            for r in await pool.fetch(
                "SELECT * FROM recipient WHERE message_id = $1 ORDER BY address", qid
            )
        ]
        for qid in (alone, batched)
    }
    assert recipients[alone] == recipients[batched] and len(recipients[alone]) == 2
    timing = await pool.fetch(
        "SELECT r.created_at = m.received_at AND r.next_attempt_at = m.received_at AS same "
        "FROM recipient r JOIN message m ON m.id = r.message_id"
    )
    assert all(t["same"] for t in timing)


async def test_enqueue_notifies_only_on_commit(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    listener = await asyncpg.connect(db_url)
    got: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener(queue.NOTIFY_CHANNEL, lambda *a: got.put_nowait(a[2]))
    try:
        async with pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            await queue.enqueue(conn, envelope(org_id))
            await asyncio.sleep(0.3)
            assert got.empty(), "NOTIFY must not be seen before commit"
            await tx.rollback()
        await asyncio.sleep(0.3)
        assert got.empty(), "a rolled-back enqueue must not notify"
        await queue.enqueue(pool, envelope(org_id))
        await asyncio.wait_for(got.get(), 5)
    finally:
        await listener.close()


async def test_claim_groups_by_message_and_domain(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    qid = await queue.enqueue(
        pool, envelope(org_id, "a@one.example", "b@two.example", "c@ONE.example")
    )
    deliveries = await claim(pool, owner=OWNER, lease=60, batch=100)
    by_domain = {d.domain: d for d in deliveries}
    assert set(by_domain) == {"one.example", "two.example"}
    assert [r.address for r in by_domain["one.example"].recipients] == [
        "a@one.example",
        "c@ONE.example",
    ]
    assert all(d.queue_id == qid and d.body.startswith(b"Subject: hi") for d in deliveries)
    assert all(r.attempts == 1 for d in deliveries for r in d.recipients)
    rows = await pool.fetch(
        "SELECT status, lease_owner, lease_until > now() AS leased FROM recipient"
    )
    assert all(
        r["status"] == "delivering" and r["lease_owner"] == OWNER and r["leased"] for r in rows
    )
    # Nothing is due any more.
    assert await claim(pool, owner=OWNER, lease=60, batch=100) == []


async def test_claim_hands_out_messages_in_the_order_they_were_received(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    ids = [
        await queue.enqueue(pool, envelope(org_id, f"r{i}@one.example", f"s{i}@two.example"))
        for i in range(5)
    ]
    deliveries = await claim(pool, owner=OWNER, lease=60, batch=100)
    assert [d.queue_id for d in deliveries if d.domain == "one.example"] == ids
    assert [d.queue_id for d in deliveries if d.domain == "two.example"] == ids
    # Each delivery carries its message's body, though the claim sent each body once.
    assert all(d.body.startswith(b"Subject: hi") for d in deliveries)


async def test_claim_skips_rows_not_yet_due(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=5, due_in=3600)
    await bulk_queue(pool, org_id, messages=3)
    deliveries = await claim(pool, owner=OWNER, lease=60, batch=100)
    assert len(deliveries) == 3


@pytest.mark.slow
async def test_eight_concurrent_claimers_take_every_row_exactly_once(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=10_000, recipients_per_message=2)
    assert await count(pool, "recipient") == 20_000

    async def claimer(name: str) -> list[uuid.UUID]:
        taken: list[uuid.UUID] = []
        async with pool.acquire() as conn:
            while True:
                batch = await claim(conn, owner=name, lease=300, batch=100)
                if not batch:
                    return taken
                taken.extend(r.id for d in batch for r in d.recipients)
                await record_attempts(conn, results_for(batch, Outcome.DELIVERED))

    results = await asyncio.gather(*(claimer(f"claimer-{i}") for i in range(8)))
    everything = [rid for taken in results for rid in taken]
    assert len(everything) == 20_000
    assert len(set(everything)) == 20_000
    assert sum(1 for taken in results if taken) > 1, "the work should be shared"
    assert (
        await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivered'") == 20_000
    )
    assert await pool.fetchval("SELECT count(*) FROM attempt WHERE applied") == 20_000


async def test_dead_claimer_holds_rows_only_until_its_lease_runs_out(
    pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=10)
    doomed = await asyncpg.connect(db_url)
    claimed = await claim(doomed, owner="doomed-node", lease=1, batch=100)
    assert len(claimed) == 10
    await doomed.close()  # dies without recording anything

    # While the lease holds, nobody else gets the rows and the sweeper leaves them alone.
    assert await claim(pool, owner=OWNER, lease=60, batch=100) == []
    assert await leases.requeue_expired_leases(pool) == 0
    await asyncio.sleep(1.3)
    assert await leases.requeue_expired_leases(pool) == 10

    again = await claim(pool, owner=OWNER, lease=60, batch=100)
    assert len(again) == 10
    assert all(r.attempts == 2 for d in again for r in d.recipients), "the lost attempt is counted"
    lost = await pool.fetch("SELECT outcome, response FROM attempt")
    assert len(lost) == 10
    assert all(r["outcome"] == "deferred" and "doomed-node" in r["response"] for r in lost)


async def test_node_restart_frees_its_own_leases_at_once(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """Runs without a row in `node` are gone (tests/integration/test_nodes.py has the live ones)."""
    await bulk_queue(pool, org_id, messages=4)
    await claim(pool, owner="node-b/run1", lease=3600, batch=2)
    await claim(pool, owner=f"{OWNER}/run1", lease=3600, batch=2)
    assert await leases.free_leases_of_gone_runs(pool, node_name=OWNER, stale_after=30) == 2
    statuses = await pool.fetch("SELECT status, lease_owner FROM recipient ORDER BY status")
    assert sorted((r["status"], r["lease_owner"]) for r in statuses) == [
        ("delivering", "node-b/run1"),
        ("delivering", "node-b/run1"),
        ("queued", None),
        ("queued", None),
    ]


async def test_record_outcomes_in_one_batch(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=3)
    deliveries = await claim(pool, owner=OWNER, lease=60, batch=100)
    delivered, deferred, bounced = deliveries
    results = (
        results_for([delivered], Outcome.DELIVERED)
        + results_for([deferred], Outcome.DEFERRED, retry_in=600, code=451)
        + results_for([bounced], Outcome.BOUNCED, code=550)
    )
    applied = await record_attempts(pool, results)
    assert len(applied) == 3
    rows = {
        r["message_id"]: r
        for r in await pool.fetch(
            "SELECT message_id, status, last_code, lease_owner, next_attempt_at - now() AS wait FROM recipient"
        )
    }
    assert rows[delivered.queue_id]["status"] == "delivered"
    assert rows[bounced.queue_id]["status"] == "bounced"
    assert rows[bounced.queue_id]["last_code"] == 550
    assert rows[deferred.queue_id]["status"] == "queued"
    assert timedelta(seconds=590) < rows[deferred.queue_id]["wait"] <= timedelta(seconds=600)
    assert all(r["lease_owner"] is None for r in rows.values())
    attempts = await pool.fetch("SELECT outcome, code, mx_host, applied FROM attempt ORDER BY code")
    assert [(a["outcome"], a["code"]) for a in attempts] == [
        ("delivered", 250),
        ("deferred", 451),
        ("bounced", 550),
    ]
    assert all(a["applied"] and a["mx_host"] == "mx.example.net" for a in attempts)


async def test_a_stale_claim_cannot_overwrite_a_newer_one(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=1)
    old = await claim(pool, owner="slow-node", lease=1, batch=1)
    await asyncio.sleep(1.2)
    await leases.requeue_expired_leases(pool)
    new = await claim(pool, owner=OWNER, lease=60, batch=1)
    # The slow node finally reports a bounce: it is logged, not applied.
    assert await record_attempts(pool, results_for(old, Outcome.BOUNCED, code=550)) == set()
    assert await pool.fetchval("SELECT status FROM recipient") == "delivering"
    assert await record_attempts(pool, results_for(new, Outcome.DELIVERED)) != set()
    assert await pool.fetchval("SELECT status FROM recipient") == "delivered"
    log = await pool.fetch(
        "SELECT outcome, applied FROM attempt WHERE code IS NOT NULL ORDER BY recorded_at"
    )
    assert [(r["outcome"], r["applied"]) for r in log] == [("bounced", False), ("delivered", True)]


async def test_stale_and_current_outcome_of_one_recipient_in_one_batch(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """Both outcomes are logged; only the current claim's is applied, and the recipient counts as
    moved (the engine must not hand it back)."""
    await bulk_queue(pool, org_id, messages=1)
    old = await claim(pool, owner="slow-node", lease=1, batch=1)
    await asyncio.sleep(1.2)
    await leases.requeue_expired_leases(pool)
    new = await claim(pool, owner=OWNER, lease=60, batch=1)
    rid = new[0].recipients[0].id
    batch = [*results_for(old, Outcome.BOUNCED, code=550), *results_for(new, Outcome.DELIVERED)]
    assert await record_attempts(pool, batch) == {rid}
    assert await pool.fetchval("SELECT status FROM recipient") == "delivered"
    log = await pool.fetch(  # code IS NULL: the sweeper's row for the lease that ran out
        "SELECT attempt, outcome, applied FROM attempt WHERE code IS NOT NULL ORDER BY attempt"
    )
    assert [(r["attempt"], r["outcome"], r["applied"]) for r in log] == [
        (1, "bounced", False),
        (2, "delivered", True),
    ]
    # An outcome for a recipient that does not exist is logged, not applied.
    ghost = AttemptResult(**{**vars(batch[1]), "recipient_id": uuid.uuid4()})
    assert await record_attempts(pool, [ghost]) == set()


async def test_renew_and_release(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=2)
    deliveries = await claim(pool, owner=OWNER, lease=5, batch=10)
    ids = [r.id for d in deliveries for r in d.recipients]
    tries = [r.attempts for d in deliveries for r in d.recipients]
    assert await leases.renew_leases(pool, ids, owner=OWNER, lease=3600, attempts=tries) == 2
    assert (
        await leases.renew_leases(pool, ids, owner="someone-else", lease=3600, attempts=tries) == 0
    )
    left = await pool.fetchval("SELECT min(lease_until - now()) FROM recipient")
    assert left > timedelta(seconds=3500)
    assert await leases.release_leases(pool, ids[:1], owner=OWNER, attempts=tries[:1]) == 1
    row = await pool.fetchrow(
        "SELECT status, attempts, lease_owner FROM recipient WHERE id = $1", ids[0]
    )
    assert (row["status"], row["attempts"], row["lease_owner"]) == ("queued", 0, None)


async def test_expiry_of_old_due_recipients(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=3, age=6 * 86400)
    await bulk_queue(pool, org_id, messages=2, age=60)
    expired = await upkeep.expire_old_recipients(pool, max_age=5 * 86400, max_age_text="5d")
    assert len(expired) == 3
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'expired'") == 3
    responses = await pool.fetch("SELECT outcome, response FROM attempt")
    assert all(r["outcome"] == "expired" and "5d" in r["response"] for r in responses)
    assert await upkeep.expire_old_recipients(pool, max_age=5 * 86400, max_age_text="5d") == []


async def test_stats_count_the_live_queue(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=4, due_in=-120)
    await bulk_queue(pool, org_id, messages=3, due_in=3600)
    await bulk_queue(pool, org_id, messages=5, status="delivered")
    await claim(pool, owner=OWNER, lease=60, batch=1)
    stats = await upkeep.queue_stats(pool)
    assert (stats.queued, stats.due, stats.delivering) == (6, 3, 1)
    assert 100 < stats.oldest_due_age < 200


async def test_claim_query_uses_the_partial_index(pool: asyncpg.Pool, org_id: uuid.UUID) -> None:
    await bulk_queue(pool, org_id, messages=100_000, status="delivered")
    await bulk_queue(pool, org_id, messages=20_000, due_in=86400)
    await bulk_queue(pool, org_id, messages=50)
    await pool.execute("ANALYZE")
    async with pool.acquire() as conn, conn.transaction():
        plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + claims._CLAIM,
            300.0,
            OWNER,
            100,
            ["transactional", "bulk"],
            [10.0, 1.0],
            0.5,
            [],
            100,
            [],
            [],
        )
        await conn.execute("ROLLBACK AND CHAIN")
    nodes = list(_plan_nodes(json.loads(plan) if isinstance(plan, str) else plan))
    scans = [
        (n["Node Type"], n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") == "recipient"
    ]
    assert ("Index Scan", "recipient_due_group") in scans, scans
    assert all(kind != "Seq Scan" for kind, _ in scans), scans


def _plan_nodes(node: object):  # type: ignore[no-untyped-def]
    if isinstance(node, list):
        for item in node:
            yield from _plan_nodes(item)
    elif isinstance(node, dict):
        if "Node Type" in node:
            yield node
        for value in node.values():
            if isinstance(value, list | dict):
                yield from _plan_nodes(value)


def _result(recipient_id: uuid.UUID, queue_id: uuid.UUID, org_id: uuid.UUID) -> AttemptResult:
    return AttemptResult(
        recipient_id=recipient_id,
        queue_id=queue_id,
        org_id=org_id,
        attempt=1,
        outcome=Outcome.DEFERRED,
        reply=Reply(451, "4.0.0", "later"),
        started_at=datetime.now(UTC),
    )


async def test_deferred_without_next_attempt_is_refused(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    with pytest.raises(ValueError):
        await record_attempts(pool, [_result(uuid.uuid4(), uuid.uuid4(), org_id)])


async def test_retention_purges_only_old_finished_messages(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    old_done = await queue.enqueue(pool, envelope(org_id, "a@example.net"))
    old_waiting = await queue.enqueue(pool, envelope(org_id, "b@example.net", "c@example.net"))
    deliveries = await claim(pool, owner=OWNER, lease=60, batch=10)
    done = [d for d in deliveries if d.queue_id == old_done]
    waiting = [d for d in deliveries if d.queue_id == old_waiting]
    await record_attempts(pool, results_for(done, Outcome.DELIVERED))
    # One of old_waiting's recipients is final, the other still deferred: the message stays.
    first, second = results_for(waiting, Outcome.DEFERRED, code=451)
    await record_attempts(
        pool,
        [
            first,
            AttemptResult(**{**vars(second), "outcome": Outcome.BOUNCED, "next_attempt_at": None}),
        ],
    )
    await asyncio.sleep(1.5)
    fresh = await queue.enqueue(pool, envelope(org_id, "d@example.net"))
    fresh_done = await claim(pool, owner=OWNER, lease=60, batch=10)
    await record_attempts(pool, results_for(fresh_done, Outcome.DELIVERED))

    # Messages received more than a second ago count as old here.
    assert await upkeep.purge_finished_messages(pool, older_than=1.0) == 1
    left = {r["id"] for r in await pool.fetch("SELECT id FROM message")}
    assert left == {old_waiting, fresh}
    assert await pool.fetchval("SELECT count(*) FROM attempt WHERE message_id = $1", old_done) == 0
    assert (
        await pool.fetchval("SELECT count(*) FROM recipient WHERE message_id = $1", old_done) == 0
    )


async def test_retention_never_purges_recent_mail_whatever_its_id(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    # Rows made by hand or by another tool may carry random (v4) ids; a tenth of them sort below
    # any recent UUIDv7. Their received time, not their id, decides.
    await bulk_queue(pool, org_id, messages=2000, status="delivered")
    low_ids = await pool.fetchval(
        "SELECT count(*) FROM message WHERE id < $1", id_floor(time.time() - 86400)
    )
    assert low_ids > 0, "the test needs some ids that sort below the cutoff"
    assert await upkeep.purge_finished_messages(pool, older_than=86400) == 0
    assert await pool.fetchval("SELECT count(*) FROM message") == 2000


async def test_release_and_renew_touch_only_the_claim_they_name(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    # Two processes of one node share its name as lease owner. Process A's claim (attempt 1) ran
    # out and process B claimed the row again (attempt 2): A's release or renewal must not touch it.
    await bulk_queue(pool, org_id, messages=1)
    [first] = await claim(pool, owner=OWNER, lease=1, batch=1)
    await asyncio.sleep(1.2)
    assert await leases.requeue_expired_leases(pool) == 1
    [second] = await claim(pool, owner=OWNER, lease=60, batch=1)
    rid = first.recipients[0].id
    assert (first.recipients[0].attempts, second.recipients[0].attempts) == (1, 2)

    assert await leases.renew_leases(pool, [rid], owner=OWNER, lease=3600, attempts=[1]) == 0
    assert await leases.release_leases(pool, [rid], owner=OWNER, attempts=[1]) == 0
    row = await pool.fetchrow("SELECT status, attempts FROM recipient WHERE id = $1", rid)
    assert (row["status"], row["attempts"]) == ("delivering", 2)

    assert await leases.renew_leases(pool, [rid], owner=OWNER, lease=3600, attempts=[2]) == 1
    assert await leases.release_leases(pool, [rid], owner=OWNER, attempts=[2]) == 1
    row = await pool.fetchrow("SELECT status, attempts FROM recipient WHERE id = $1", rid)
    assert (row["status"], row["attempts"]) == ("queued", 1)


async def test_fenced_statements_look_up_their_rows_by_primary_key_with_many_in_flight(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """Record, renew and release name their rows by id. With statistics taken while nothing was
    in flight and then 5,000 rows in flight, they must still go by primary key, not scan every
    in-flight row (migration 0006); the sweeper and the in-flight count use recipient_leased."""
    await bulk_queue(pool, org_id, messages=20_000, status="delivered")
    await bulk_queue(pool, org_id, messages=5_000)
    await pool.execute("VACUUM ANALYZE recipient")  # statistics: nothing in flight
    claimed = [d for _ in range(50) for d in await claim(pool, owner=OWNER, lease=300, batch=100)]
    rows = [(d, r) for d in claimed for r in d.recipients][:100]
    results = results_for([d for d, _ in rows], Outcome.DELIVERED)[:100]
    async with pool.acquire() as conn:
        record = await _recipient_scans(
            conn, outcomes._RECORD, *outcomes._record_arguments(results)
        )
        ids = [r.id for _, r in rows]
        attempts = [r.attempts for _, r in rows]
        renew = await _recipient_scans(conn, leases._RENEW_FENCED, ids, OWNER, 300.0, attempts)
        none = [None] * len(ids)
        release = await _recipient_scans(
            conn, leases._RELEASE_FENCED, ids, OWNER, attempts, none, none, none
        )
        sweep = await _recipient_scans(conn, leases._SWEEP, 100)
        count = await _recipient_scans(conn, upkeep._STATS)
    for scans in (record, renew, release):
        assert ("Index Scan", "recipient_pkey") in scans, scans
        assert all(name != "recipient_leased" for _, name in scans), scans
    assert ("Index Scan", "recipient_leased") in sweep, sweep
    assert all(kind != "Seq Scan" for kind, _ in sweep + count), (sweep, count)
    assert any(name == "recipient_leased" for _, name in count), count


# The parameter types of outcomes._RECORD, for a PREPARE of it.
_RECORD_TYPES = (
    "uuid[], uuid[], uuid[], uuid[], int[], text[], timestamptz[], float8[], timestamptz[], "
    "text[], text[], int[], text[], text[], int[], text[], text[], text[], text[], text[], text, "
    "uuid[], int[], int, float8"
)


async def test_the_record_planned_once_on_an_empty_table_still_goes_by_primary_key(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """The engine's record connections plan the record once (store/connect.py `record_pool`).
    Made while the table is empty, that plan must still find the rows by primary key once 25,000
    rows are there and 5,000 in flight, rather than read every in-flight row."""
    conn = await asyncpg.connect(db_url, server_settings=server_settings(Settings(), by_key=True))
    try:
        types = _RECORD_TYPES.split(", ")
        await conn.execute(f"PREPARE record ({_RECORD_TYPES}) AS {outcomes._RECORD}")

        async def scans(results: list[AttemptResult]) -> list[tuple[str, str | None]]:
            # EXPLAIN EXECUTE takes no bound parameters: the values go in as literals, which
            # the server writes itself.
            literals = [
                await conn.fetchval(f"SELECT quote_nullable($1::{t}) || '::{t}'", value)
                for t, value in zip(types, outcomes._record_arguments(results), strict=True)
            ]
            plan = await _recipient_scans(conn, f"EXECUTE record ({', '.join(literals)})")
            return [node for node in plan if node[0] != "ModifyTable"]

        await bulk_queue(pool, org_id, messages=1)
        first = await claim(pool, owner=OWNER, lease=300, batch=1)
        assert await scans(results_for(first, Outcome.DELIVERED)) == [
            ("Index Scan", "recipient_pkey")
        ]
        await bulk_queue(pool, org_id, messages=20_000, status="delivered")
        await bulk_queue(pool, org_id, messages=5_000)
        claimed = [
            d for _ in range(50) for d in await claim(pool, owner=OWNER, lease=300, batch=100)
        ]
        later = await scans(results_for(claimed, Outcome.DELIVERED)[:100])
    finally:
        await conn.close()
    assert later == [("Index Scan", "recipient_pkey")]


async def _recipient_scans(
    conn: asyncpg.Connection, sql: str, *args: object
) -> list[tuple[str, str | None]]:
    async with conn.transaction():
        plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, *args)
        await conn.execute("ROLLBACK AND CHAIN")
    nodes = list(_plan_nodes(json.loads(plan) if isinstance(plan, str) else plan))
    return [
        (n["Node Type"], n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") == "recipient"
    ]
