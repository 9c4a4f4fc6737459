"""The outbox relay on two real databases: what an application commits is queued once, what it
rolls back never; a refused row gets the API's sentence and holds back no other; a relay that
dies between its commit and the write-back leaves the next one to answer the row with the same
message; two relays of one outbox queue each key once; a lost application database is connected
again.

application ──one transaction──► app database (orders, pigeon_outbox)
                                   │ OutboxRelay, two of them (FOR UPDATE SKIP LOCKED)
                                   ▼
                    pigeon-mta's database (message, recipient, outbox_key)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from pigeon_mta import metrics
from pigeon_mta.config import Settings
from pigeon_mta.intake.accept import Intake
from pigeon_mta.outbox.relay import OutboxRelay, PigeonTrouble
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from tests.integration.outbox_helpers import api_message, install, outbox_settings, write_order


@pytest.fixture
async def app(app_db_url: str) -> AsyncIterator[asyncpg.Connection]:
    await install(app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def acme(pool: asyncpg.Pool) -> uuid.UUID:
    org = await store_orgs.ensure_org(pool, "acme")
    await store_domains.add_sender_domain(pool, org, "acme.example")
    other = await store_orgs.ensure_org(pool, "other")
    await store_domains.add_sender_domain(pool, other, "other.example")
    return org


def relay_of(pool: asyncpg.Pool, app_db_url: str, **changes: object) -> OutboxRelay:
    settings = Settings()
    outbox = outbox_settings(app_db_url, **changes)  # type: ignore[arg-type]
    settings = dataclasses.replace(settings, outbox=(outbox,))
    return OutboxRelay(settings, outbox, pool, Intake.of(settings, pool))


async def queued_keys(pool: asyncpg.Pool) -> list[str]:
    """The Message-IDs queued, one per message, in order."""
    rows = await pool.fetch("SELECT header_message_id FROM message ORDER BY received_at, id")
    return [r["header_message_id"] for r in rows]


async def test_a_rollback_sends_nothing_and_a_commit_queues_once(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    relay = relay_of(pool, app_db_url)
    tx = app.transaction()
    await tx.start()
    await app.execute("INSERT INTO orders (id, total) VALUES (1, 10)")
    await app.execute(
        "INSERT INTO pigeon_outbox (idempotency_key, message) VALUES ('order-1', $1::jsonb)",
        api_message(1),
    )
    conn = await asyncpg.connect(app_db_url)
    try:
        # Not committed yet: the relay does not see it; rolled back, it never will.
        assert (await relay.relay_round(conn)).taken == 0
        await tx.rollback()
        assert (await relay.relay_round(conn)).taken == 0
        await write_order(app, 2)
        done = await relay.relay_round(conn)
        assert (len(done.relayed), done.refused) == (1, [])
        assert (await relay.relay_round(conn)).taken == 0
    finally:
        await conn.close()
    assert await queued_keys(pool) == ["order-2@shop.example"]
    row = await app.fetchrow("SELECT queue_id, relayed_at, error FROM pigeon_outbox")
    assert row["relayed_at"] is not None and row["error"] is None
    message = await pool.fetchrow(
        "SELECT id, org_id, listener, auth_user, body FROM message WHERE id = $1", row["queue_id"]
    )
    assert (message["org_id"], message["listener"], message["auth_user"]) == (
        acme,
        "outbox",
        "outbox:shop",
    )
    assert b"X-Pigeon-Submitted: by " in message["body"] and b"over outbox shop" in message["body"]
    recipients = await pool.fetch(
        "SELECT address FROM recipient WHERE message_id = $1", message["id"]
    )
    assert [r["address"] for r in recipients] == ["buyer@dest.test"]


async def test_a_refused_row_gets_the_apis_sentence_and_the_rows_after_it_flow(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    await write_order(app, 1)
    await write_order(app, 2, message=api_message(2, sender="shop@other.example"))
    await write_order(app, 3, message=json.dumps({"from": "shop@acme.example"}))
    await write_order(app, 4)
    relay = relay_of(pool, app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        done = await relay.relay_round(conn)
        assert (len(done.relayed), len(done.refused), done.waiting) == (2, 2, 0)
        # A refused row stays refused: the next round leaves it to the application.
        assert (await relay.relay_round(conn)).taken == 0
    finally:
        await conn.close()
    rows = await app.fetch("SELECT idempotency_key, queue_id, error FROM pigeon_outbox ORDER BY id")
    assert [(r["idempotency_key"], r["queue_id"] is not None) for r in rows] == [
        ("order-1", True),
        ("order-2", False),
        ("order-3", False),
        ("order-4", True),
    ]
    assert rows[1]["error"] == (
        "The sender 'shop@other.example' in 'from' is not at one of the sender domains of the "
        "org 'acme'."
    )
    assert rows[2]["error"] == "The fields 'to', 'cc' and 'bcc' name no recipient."
    # What `outbox list` and the gauges read: nothing waits, two rows are refused.
    backlog = await relay.table.backlog(app)
    assert (backlog.waiting, backlog.oldest_age, backlog.refused) == (0, None, 2)
    assert backlog.last_relayed is not None
    assert await queued_keys(pool) == ["order-1@shop.example", "order-4@shop.example"]

    # The application corrects the row and clears its error: it is relayed.
    await app.execute(
        "UPDATE pigeon_outbox SET message = $1::jsonb, error = NULL WHERE idempotency_key = $2",
        api_message(2),
        "order-2",
    )
    conn = await asyncpg.connect(app_db_url)
    try:
        assert len((await relay.relay_round(conn)).relayed) == 1
    finally:
        await conn.close()
    assert sorted(await queued_keys(pool)) == [f"order-{n}@shop.example" for n in (1, 2, 4)]
    await write_order(app, 9)
    waiting = await relay.table.backlog(app)
    assert waiting.waiting == 1 and waiting.oldest_age is not None and waiting.oldest_age >= 0


async def test_a_relay_that_dies_before_its_write_back_is_answered_with_the_same_message(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    for n in range(1, 6):
        await write_order(app, n)
    relay = relay_of(pool, app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        # The messages are committed in pigeon-mta's database, and the application's
        # transaction dies before it writes their queue ids back.
        with pytest.raises(ConnectionResetError):
            async with conn.transaction():
                rows = await relay.table.claim(conn, 100)
                first = await relay._relay(rows)
                raise ConnectionResetError
        assert len(first.relayed) == 5
        assert await app.fetchval("SELECT count(*) FROM pigeon_outbox WHERE queue_id IS NULL") == 5
        again = await relay.relay_round(conn)
    finally:
        await conn.close()
    assert (len(again.relayed), again.repeats) == (5, 5)
    assert sorted(again.relayed) == sorted(first.relayed)
    assert len(await queued_keys(pool)) == 5
    written = await app.fetch("SELECT id, queue_id FROM pigeon_outbox ORDER BY id")
    assert [(r["id"], r["queue_id"]) for r in written] == sorted(first.relayed)


async def test_keys_given_but_not_committed_are_queued_under_their_queue_ids(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    """A relay that died after its keys took their queue ids and before the commit: the next
    round commits the messages under those ids."""
    await write_order(app, 1)
    given = uuid.UUID("01900000-0000-7000-8000-000000000001")
    await pool.execute(
        "INSERT INTO outbox_key (org_id, outbox, key, queue_id) VALUES ($1, 'shop', 'order-1', $2)",
        acme,
        given,
    )
    relay = relay_of(pool, app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        done = await relay.relay_round(conn)
    finally:
        await conn.close()
    assert (done.relayed, done.repeats) == ([(1, given)], 0)
    assert await pool.fetchval("SELECT count(*) FROM message WHERE id = $1", given) == 1


async def test_two_relays_of_one_outbox_queue_each_key_once(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    await app.execute(
        """INSERT INTO pigeon_outbox (idempotency_key, message)
           SELECT 'order-' || n, jsonb_build_object('from', 'shop@acme.example',
                  'to', jsonb_build_array('buyer' || n || '@dest.test'), 'subject', 'order ' || n,
                  'text', 'thanks')
           FROM generate_series(1, 600) AS n"""
    )
    relays = [relay_of(pool, app_db_url, batch=50) for _ in range(2)]
    conns = [await asyncpg.connect(app_db_url) for _ in relays]

    async def drain(relay: OutboxRelay, conn: asyncpg.Connection) -> int:
        total = 0
        while (done := await relay.relay_round(conn)).taken:
            total += len(done.relayed)
        return total

    try:
        counts = await asyncio.gather(*(drain(r, c) for r, c in zip(relays, conns, strict=True)))
    finally:
        for conn in conns:
            await conn.close()
    assert sum(counts) == 600 and all(counts)
    assert await pool.fetchval("SELECT count(*) FROM message") == 600
    assert await pool.fetchval("SELECT count(DISTINCT address) FROM recipient") == 600
    assert await app.fetchval("SELECT count(*) FROM pigeon_outbox WHERE relayed_at IS NULL") == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox_key") == 600


async def test_a_lost_application_database_is_connected_again(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    relay = relay_of(pool, app_db_url, poll_interval=0.2)
    reachable = metrics.OUTBOX_REACHABLE.labels(outbox="shop")
    await relay.start()
    try:
        await write_order(app, 1)
        await _until(lambda: _relayed(app), 1)
        assert reachable._value.get() == 1
        # The application's database drops the relay's connection.
        await app.execute(
            """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
               WHERE datname = current_database() AND pid <> pg_backend_pid()"""
        )
        await write_order(app, 2)
        await _until(lambda: _relayed(app), 2)
        assert reachable._value.get() == 1
    finally:
        await relay.stop(asyncio.get_running_loop().time() + 5)
    assert reachable._value.get() == 0
    assert len(await queued_keys(pool)) == 2


async def _relayed(app: asyncpg.Connection) -> int:
    return int(
        await app.fetchval("SELECT count(*) FROM pigeon_outbox WHERE relayed_at IS NOT NULL")
    )


async def _until(read: object, value: int, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await read() == value:  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not {value} within {timeout}s")


async def test_rows_of_one_ordering_key_are_queued_in_the_order_written(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    for n in range(1, 4):
        body = json.loads(api_message(n))
        await write_order(app, n, message=json.dumps({**body, "order_key": "cart-9"}))
    await write_order(app, 4)  # no key
    await write_order(app, 5, message=api_message(5, sender="shop@acme.example"))
    relay = relay_of(pool, app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        # A keyed row waits while an earlier row of its key waits: one of the key per round.
        first = await relay.relay_round(conn)
        assert sorted(i for i, _ in first.relayed) == [1, 4, 5]
        assert [i for i, _ in (await relay.relay_round(conn)).relayed] == [2]
        assert [i for i, _ in (await relay.relay_round(conn)).relayed] == [3]
    finally:
        await conn.close()
    places = await pool.fetch(
        """SELECT m.header_message_id, r.order_at FROM recipient r JOIN message m
           ON m.id = r.message_id WHERE r.order_key = 'cart-9' ORDER BY r.order_at"""
    )
    assert [p["header_message_id"] for p in places] == [
        f"order-{n}@shop.example" for n in (1, 2, 3)
    ]


async def test_a_hostile_value_refuses_its_row_and_the_relay_goes_on(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    body = json.loads(api_message(1))
    await write_order(app, 1, message=json.dumps({**body, "send_at": "0001-01-01T00:00:00+01:00"}))
    await write_order(app, 2)
    relay = relay_of(pool, app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        done = await relay.relay_round(conn)
    finally:
        await conn.close()
    assert [i for i, _ in done.relayed] == [2]
    assert done.refused == [(1, "The field 'send_at' is not a time.")]


async def test_relayed_rows_past_retention_are_deleted_with_their_keys(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    for n in range(1, 4):
        await write_order(app, n)
    relay = relay_of(pool, app_db_url, retention=3600)
    conn = await asyncpg.connect(app_db_url)
    try:
        assert len((await relay.relay_round(conn)).relayed) == 3
        await app.execute(
            "UPDATE pigeon_outbox SET relayed_at = now() - interval '2 hours' WHERE id <> 3"
        )
        await pool.execute(
            "UPDATE outbox_key SET created_at = now() - interval '2 days' WHERE key <> 'order-3'"
        )
        await relay._prune(conn)
    finally:
        await conn.close()
    left = await app.fetch("SELECT idempotency_key FROM pigeon_outbox")
    assert [r["idempotency_key"] for r in left] == ["order-3"]
    keys = await pool.fetch("SELECT key FROM outbox_key")
    assert [r["key"] for r in keys] == ["order-3"]
    # The messages themselves are pigeon-mta's history, kept by [retention] as any other.
    assert await pool.fetchval("SELECT count(*) FROM message") == 3


async def test_rows_wait_while_pigeons_database_fails_and_flow_after(
    pool: asyncpg.Pool, app: asyncpg.Connection, app_db_url: str, acme: uuid.UUID
) -> None:
    """pigeon-mta's database failing mid-round (its keys unreadable, then its commits refused)
    is pigeon's trouble: the rows get no error and wait, and are relayed once it is back."""
    for n in (1, 2):
        await write_order(app, n)
    relay = relay_of(pool, app_db_url)
    conn = await asyncpg.connect(app_db_url)
    try:
        await pool.execute("ALTER TABLE outbox_key RENAME TO outbox_key_away")
        with pytest.raises(PigeonTrouble):
            await relay.relay_round(conn)
        await pool.execute("ALTER TABLE outbox_key_away RENAME TO outbox_key")
        await pool.execute(
            """CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'the disk is full'; END $$;
               CREATE TRIGGER refuse BEFORE INSERT ON message
               FOR EACH ROW EXECUTE FUNCTION refuse()"""
        )
        refused = await relay.relay_round(conn)
        assert (refused.relayed, refused.refused, refused.waiting) == ([], [], 2)
        assert (
            await app.fetchval(
                "SELECT count(*) FROM pigeon_outbox WHERE error IS NULL AND relayed_at IS NULL"
            )
            == 2
        )
        await pool.execute("DROP TRIGGER refuse ON message")
        done = await relay.relay_round(conn)
    finally:
        await conn.close()
    assert len(done.relayed) == 2 and await queued_keys(pool) == [
        "order-1@shop.example",
        "order-2@shop.example",
    ]
