"""The admin commands and the retention purge read a large queue through indexes.

Each test fills a database with a history big enough for the planner to prefer an index where
one fits, runs the call the CLI (or the service) makes, on a connection with the service's session
settings, and asks PostgreSQL what the call read (pg_stat_xact_user_tables): a
sequential scan, or a fetch of every row of an address's history, is what made these calls take
seconds on a table of a million rows (bench/admin_bench.py). No timing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import asyncpg
import pytest

from pigeon_mta.config import Settings
from pigeon_mta.store import admin_queue, events, upkeep
from pigeon_mta.store.admin_queue import Selection
from pigeon_mta.store.connect import server_settings
from tests.integration.queue_helpers import bulk_queue

HISTORY = 8_000  # finished messages, received 40 to 10 days ago, oldest first
HOT = "hot@example.net"  # every fourth of them: 2,000 messages
MANUAL = 2_000  # suppression entries added by hand (no attempt)
WEEK = 7 * 86400.0
T = TypeVar("T")


def uuid7(ts: str) -> str:
    """SQL for a UUIDv7-like id made at `ts`, as pigeon_mta.ids makes them (time first)."""
    return (
        "encode(overlay(uuid_send(gen_random_uuid()) placing "
        f"substring(int8send(floor(extract(epoch from {ts}) * 1000)::bigint) from 3) "
        "from 1 for 6), 'hex')::uuid"
    )


# One recipient and one attempt per message; a tenth bounced, each bounce on the suppression
# list pointing at its attempt (as the engine records it).
_HISTORY = f"""
WITH h AS MATERIALIZED (
    SELECT n, t, {uuid7("t")} AS mid, {uuid7("t")} AS rid, {uuid7("t")} AS aid,
           n % 10 = 0 AS bounced,
           CASE WHEN n % 4 = 1 THEN '{HOT}' ELSE 'u' || n || '@example.net' END AS address
    FROM (SELECT n, now() - interval '40 days' + n * (interval '30 days' / $2) AS t
          FROM generate_series(1, $2) AS n) s
), m AS (
    INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
    SELECT mid, $1, 'sender@example.com', 20, 'Subject: t\r\n\r\nbody\r\n', 'test', t FROM h
), r AS (
    INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts, created_at,
                           next_attempt_at)
    SELECT rid, mid, $1, address, 'example.net', CASE WHEN bounced THEN 'bounced'
           ELSE 'delivered' END, 1, t, t
    FROM h
), a AS (
    INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, code, outcome)
    SELECT aid, rid, mid, $1, 1, t, CASE WHEN bounced THEN 550 ELSE 250 END,
           CASE WHEN bounced THEN 'bounced' ELSE 'delivered' END
    FROM h
)
INSERT INTO suppression (id, org_id, address, reason, source, attempt_id, created_at)
SELECT rid, $1, address, '550 no such user', 'bounce', aid, t FROM h WHERE bounced
UNION ALL
SELECT gen_random_uuid(), $1, 'm' || k || '@example.org', 'by hand', 'manual', NULL, now()
FROM generate_series(1, $3) AS k
"""


@dataclass(frozen=True)
class Reads:
    seq_scan: int  # sequential scans of the table
    rows: int  # rows read: by sequential scans, and fetched through indexes

    def __sub__(self, other: Reads) -> Reads:
        return Reads(self.seq_scan - other.seq_scan, self.rows - other.rows)


async def _counted(conn: asyncpg.Connection) -> dict[str, Reads]:
    # The backend's counts not yet reported: this transaction's, and possibly earlier ones'.
    rows = await conn.fetch(
        """SELECT relname, seq_scan, seq_tup_read + idx_tup_fetch AS rows
           FROM pg_stat_xact_user_tables"""
    )
    return {r["relname"]: Reads(r["seq_scan"], r["rows"]) for r in rows}


async def reads_of(
    conn: asyncpg.Connection, call: Callable[[], Awaitable[T]]
) -> tuple[T, dict[str, Reads]]:
    """Run `call` in the connection's open transaction; returns its result and what it read of
    each table (PostgreSQL reports a backend's counts only between transactions, so the
    difference taken inside one is the call's own)."""
    assert conn.is_in_transaction()
    before = await _counted(conn)
    result = await call()
    after = await _counted(conn)
    return result, {table: after[table] - before[table] for table in after}


@pytest.fixture
async def big(db_url: str, org_id: uuid.UUID) -> AsyncIterator[asyncpg.Connection]:
    """A connection as the CLI opens it, to a queue with history, a live part and a suppression
    list: 300 fresh, 100 deferred (slow.example) and 50 being delivered recipients."""
    conn = await asyncpg.connect(db_url, server_settings=server_settings(Settings()))
    try:
        await conn.execute(_HISTORY, org_id, HISTORY, MANUAL)
        await bulk_queue_live(conn, org_id)
        await conn.execute("VACUUM ANALYZE")
        yield conn
    finally:
        await conn.close()


async def bulk_queue_live(conn: asyncpg.Connection, org_id: uuid.UUID) -> None:
    await bulk_queue(conn, org_id, messages=300, age=60)
    await bulk_queue(conn, org_id, messages=100, due_in=600, age=30, domain="slow.example")
    await conn.execute("UPDATE recipient SET attempts = 2 WHERE domain = 'slow.example'")
    await bulk_queue(conn, org_id, messages=50, status="delivering")


async def test_purge_batch_reads_neither_the_suppression_list_nor_the_history(
    big: asyncpg.Connection,
) -> None:
    async with big.transaction():
        purged, read = await reads_of(
            big, lambda: upkeep.purge_finished_messages(big, older_than=WEEK, limit=20)
        )
        assert purged == 20
        # Each deleted attempt clears the suppression entries pointing at it (ON DELETE SET
        # NULL): looked up by index, not by reading the list once per attempt.
        assert read["suppression"].seq_scan == 0, read["suppression"]
        # The check that a message has no live recipient reads that message's recipients only.
        assert read["recipient"].seq_scan == 0, read["recipient"]
        assert read["recipient"].rows < 200, read["recipient"]
    # The purged bounces stay suppressed; only their link to the deleted attempt goes.
    kept = await big.fetchval(
        "SELECT count(*) FROM suppression WHERE source = 'bounce' AND attempt_id IS NULL"
    )
    assert kept == 2


async def test_dry_runs_count_rows_in_flight_through_the_lease_index(
    big: asyncpg.Connection,
) -> None:
    async with big.transaction():
        retry, retry_read = await reads_of(
            big,
            lambda: admin_queue.bulk_action(
                big,
                "retry",
                Selection(statuses=("deferred",), domain="slow.example"),
                dry_run=True,
            ),
        )
        cancel, cancel_read = await reads_of(
            big, lambda: admin_queue.bulk_action(big, "cancel", Selection(), dry_run=True)
        )
    assert (retry.count, retry.delivering) == (100, 0)
    assert (cancel.count, cancel.delivering) == (400, 50)
    assert retry_read["recipient"].seq_scan == 0, retry_read["recipient"]
    assert cancel_read["recipient"].seq_scan == 0, cancel_read["recipient"]


async def test_queue_list_reads_only_the_live_rows_it_shows(big: asyncpg.Connection) -> None:
    async with big.transaction():
        rows, read = await reads_of(
            big, lambda: admin_queue.list_recipients(big, Selection(), limit=20)
        )
        deferred, deferred_read = await reads_of(
            big,
            lambda: admin_queue.list_recipients(
                big, Selection(statuses=("deferred",), domain="slow.example"), limit=20
            ),
        )
    oldest = await big.fetch(
        """SELECT id FROM recipient WHERE status IN ('queued', 'delivering')
           ORDER BY created_at, id LIMIT 20"""
    )
    assert [r.id for r in rows] == [r["id"] for r in oldest]
    assert len(deferred) == 20 and {r.address.split("@")[1] for r in deferred} == {"slow.example"}
    for recipient in (read["recipient"], deferred_read["recipient"]):
        assert recipient.seq_scan == 0, recipient
        assert recipient.rows < 200, recipient


async def test_log_of_an_address_reads_its_newest_messages_only(
    big: asyncpg.Connection,
) -> None:
    async with big.transaction():
        lookup, read = await reads_of(
            big, lambda: events.find_stories(big, "Hot@Example.NET", limit=10)
        )
    assert lookup is not None and lookup.found_by == "recipient address"
    newest = await big.fetch(
        "SELECT message_id FROM recipient WHERE address = $1 ORDER BY created_at DESC LIMIT 10",
        HOT,
    )
    assert {s.message.id for s in lookup.stories} == {r["message_id"] for r in newest}
    # The address has 2,000 messages; ten of them (and their recipients) are read.
    assert read["recipient"].rows < 200, read["recipient"]
