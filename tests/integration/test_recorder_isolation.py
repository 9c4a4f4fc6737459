"""The recorder on a real PostgreSQL: a result that cannot be recorded never holds the others, and a
recorder that cannot record at all says so (metrics, /readyz).

Each test claims real rows and hands the recorder results for them, some of them unrecordable as
they are: values the database refuses, a DSN whose recipient row the database refuses, a result
no record statement takes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import string
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from pigeon_mta import metrics
from pigeon_mta.config import BounceSettings, Duration, Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.model import AttemptResult, Outcome, Reply
from pigeon_mta.observability.exposition import MetricsExposition
from pigeon_mta.observability.health import Readiness
from pigeon_mta.outbound.claims import Claims
from pigeon_mta.outbound.recorder import Recorder
from tests.integration.outbound_helpers import send
from tests.integration.queue_helpers import bulk_queue, claim, results_for

OWNER = "node-a"


def failures(step: str) -> float:
    return metrics.RECORD_FAILURES.labels(step=step)._value.get()  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_stall_left() -> Iterator[None]:
    yield
    metrics.RECORDERS_STALLED.set(0)


async def _record_all(recorder: Recorder, results: list[AttemptResult]) -> None:
    running = asyncio.create_task(recorder.run())
    recorder.submit(results)
    recorder.finish()
    await asyncio.wait_for(running, 30)


async def test_values_the_database_refuses_cost_one_result_not_the_batch(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=100)
    deliveries = await claim(pool, owner=OWNER, lease=300, batch=100)
    results = results_for(deliveries, Outcome.DELIVERED)
    # A reply code no integer column holds: the record refuses it as it is (asyncpg DataError).
    results[17] = dataclasses.replace(results[17], reply=Reply(10**12, "2.0.0", "ok"))
    # A deferred result without its next attempt: no record statement takes it, plain or not.
    results[60] = dataclasses.replace(results[60], outcome=Outcome.DEFERRED)
    claims = Claims(pool, owner=OWNER, lease=300)
    claims.hold(deliveries, asyncio.get_running_loop().time())
    recorder = Recorder(pool, Settings(), claims, DeliveryLog.open(""))
    isolated, dropped = failures("isolated"), failures("dropped")

    await _record_all(recorder, results)

    rows = {
        r["id"]: r
        for r in await pool.fetch("SELECT id, status, last_code, last_response FROM recipient")
    }
    refused, undone = results[17].recipient_id, results[60].recipient_id
    assert all(
        rows[r.recipient_id]["status"] == "delivered" for r in results if r.recipient_id != undone
    )
    # The refused value is recorded plain: its outcome kept, the code it could not store gone,
    # and why, in the text.
    assert rows[refused]["last_code"] is None
    assert "recorded plain: DataError" in rows[refused]["last_response"]
    rule = await pool.fetchval("SELECT rule FROM attempt WHERE recipient_id = $1", refused)
    assert rule.endswith("record-failed")
    # The one no statement takes is dropped: still delivering under its lease, which runs out.
    assert rows[undone]["status"] == "delivering"
    assert await pool.fetchval("SELECT count(*) FROM attempt") == 99
    assert failures("isolated") == isolated + 2
    assert failures("dropped") == dropped + 1
    assert len(claims) == 0 and not recorder.pending


def dsn_failures(step: str) -> float:
    return metrics.DSN_FAILURES.labels(step=step)._value.get()  # type: ignore[attr-defined]


async def _bounced_results(
    pool: asyncpg.Pool, claims: Claims, batch: int = 10
) -> list[AttemptResult]:
    deliveries = await claim(pool, owner=OWNER, lease=300, batch=batch)
    claims.hold(deliveries, asyncio.get_running_loop().time())
    return [
        dataclasses.replace(
            r,
            reply=Reply(550, "5.1.1", "user unknown"),
            category="invalid-recipient",
            rule="permanent; unknown-mailbox",
        )
        for r in results_for(deliveries, Outcome.BOUNCED)
    ]


async def _dsn_recipients(pool: asyncpg.Pool) -> list[str]:
    rows = await pool.fetch(
        "SELECT r.address FROM recipient r JOIN message m ON m.id = r.message_id "
        "WHERE m.sender = '' ORDER BY r.address"
    )
    return [r["address"] for r in rows]


async def test_a_dsn_the_database_refuses_is_left_out_and_the_others_queued(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    # An envelope sender whose DSN recipient row cannot be indexed (btree rows stop near 2.7 KB;
    # random letters do not compress below that).
    rng = random.Random(5)
    long_sender = "".join(rng.choices(string.ascii_letters, k=9000)) + "@own.test"
    poisoned = await send(pool, org_id, "nobody@example.test", sender=long_sender)
    healthy = await send(pool, org_id, "nobody@example.test")
    claims = Claims(pool, owner=OWNER, lease=300)
    results = await _bounced_results(pool, claims)
    recorder = Recorder(pool, Settings(), claims, DeliveryLog.open(""))
    refused, isolated = dsn_failures("refused"), failures("isolated")

    await _record_all(recorder, results)

    rows = await pool.fetch(
        "SELECT message_id, status FROM recipient WHERE address = 'nobody@example.test'"
    )
    assert {r["message_id"]: r["status"] for r in rows} == {
        poisoned: "bounced",
        healthy: "bounced",
    }
    # The healthy bounce's DSN, not the refused one; and both outcomes in one record.
    assert await _dsn_recipients(pool) == ["alice@sender.test"]
    assert dsn_failures("refused") == refused + 1
    assert failures("isolated") == isolated
    assert not recorder.pending


async def test_a_suppression_the_database_refuses_leaves_the_bounce_recorded_without_it(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await send(pool, org_id, "nobody@example.test")
    claims = Claims(pool, owner=OWNER, lease=300)
    results = await _bounced_results(pool, claims)
    # An entry lifetime beyond what an interval holds (config refuses it: this is the database
    # refusing a value, as it may for reasons nobody has met yet).
    settings = dataclasses.replace(Settings(), bounces=BounceSettings(suppress_for=Duration(1e300)))
    recorder = Recorder(pool, settings, claims, DeliveryLog.open(""))
    without = failures("without_notices")

    await _record_all(recorder, results)

    assert await pool.fetchval("SELECT status FROM recipient") == "bounced"
    assert await pool.fetchval("SELECT count(*) FROM suppression") == 0
    assert failures("without_notices") == without + 1
    assert not recorder.pending


async def test_a_recorder_without_its_database_is_stalled_and_the_node_not_ready(
    admin_url: str, db_url: str, org_id: uuid.UUID, pool: asyncpg.Pool
) -> None:
    await bulk_queue(pool, org_id, messages=5)
    deliveries = await claim(pool, owner=OWNER, lease=300, batch=5)
    results = results_for(deliveries, Outcome.DELIVERED)
    name = db_url.rsplit("/", 1)[1]
    record_pool = await asyncpg.create_pool(db_url, min_size=0, max_size=2)
    assert record_pool is not None
    admin = await asyncpg.connect(admin_url)
    claims = Claims(pool, owner=OWNER, lease=300)
    claims.hold(deliveries, asyncio.get_running_loop().time())
    recorder = Recorder(record_pool, Settings(), claims, DeliveryLog.open(""), stall_after=0.5)
    readiness = Readiness(pool, MetricsExposition(None), [], 1, asyncio.Event())
    database = failures("database")
    running = asyncio.create_task(recorder.run())
    try:
        # The database refuses new connections (as one being restarted does).
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        recorder.submit(results)
        deadline = asyncio.get_running_loop().time() + 20
        while not recorder.stalled:
            assert asyncio.get_running_loop().time() < deadline, "never stalled"
            await asyncio.sleep(0.1)
        assert len(recorder.pending) == 5  # kept, every one
        assert failures("database") > database
        assert metrics.RECORDERS_STALLED._value.get() == 1  # type: ignore[attr-defined]
        checks = {c.name: c for c in await readiness.checks()}
        assert not checks["recorder"].ok

        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        while recorder.pending:
            assert asyncio.get_running_loop().time() < deadline + 20, "never recorded"
            await asyncio.sleep(0.1)
        assert not recorder.stalled
        assert (await readiness.checks())[-1].ok
        delivered = await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivered'")
        assert delivered == 5
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
        recorder.finish()
        await asyncio.wait_for(running, 30)
        await record_pool.close()


async def test_an_error_every_result_meets_keeps_the_batch_instead_of_dropping_it(
    admin_url: str, db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A record pool whose role may not write the queue (a grant revoked, 42501): every result
    fails alike, and is nothing about the result. The batch is kept for a retry, none of it
    split, recorded plain or dropped (dropping would send the mail again after the leases)."""
    await bulk_queue(pool, org_id, messages=4)
    deliveries = await claim(pool, owner=OWNER, lease=300, batch=4)
    role = f"pigeon_norights_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD 'no-rights'")
    parts = urlsplit(db_url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    netloc = f"{role}:no-rights@{host}" + (f":{parts.port}" if parts.port else "")
    user_url = urlunsplit(parts._replace(netloc=netloc))
    record_pool = await asyncpg.create_pool(user_url, min_size=0, max_size=1)
    assert record_pool is not None
    claims = Claims(pool, owner=OWNER, lease=300)
    claims.hold(deliveries, asyncio.get_running_loop().time())
    recorder = Recorder(record_pool, Settings(), claims, DeliveryLog.open(""))
    before = {s: failures(s) for s in metrics.RECORD_FAILURE_STEPS}
    try:
        done, error = await recorder.record_isolating(results_for(deliveries, Outcome.DELIVERED))
    finally:
        await record_pool.close()
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()
    assert done == 0 and isinstance(error, asyncpg.InsufficientPrivilegeError)
    assert {s: failures(s) for s in metrics.RECORD_FAILURE_STEPS} == before
    assert await pool.fetchval("SELECT count(*) FROM attempt") == 0
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivering'") == 4
