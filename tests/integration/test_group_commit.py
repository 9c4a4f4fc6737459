"""Group commit of the submission path on a real PostgreSQL: messages that arrive together share a
commit; each caller still learns its own message's fate."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from pigeon_mta.ids import new_id
from pigeon_mta.model import Envelope
from pigeon_mta.store.group_commit import GroupCommit


def envelope(org_id: uuid.UUID, n: int, *, sender: str = "app@example.com") -> Envelope:
    return Envelope(
        org_id=org_id,
        sender=sender,
        recipients=(f"a{n}@example.net", f"b{n}@example.org"),
        body=b"Subject: %d\r\n\r\nbody\r\n" % n,
        listener="relay",
        client_ip="127.0.0.1",
    )


async def test_messages_arriving_together_share_commits_and_all_land(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    group = GroupCommit(pool, max_batch=16, max_commits=2)
    ids = [new_id() for _ in range(40)]

    await asyncio.gather(*(group.enqueue(q, envelope(org_id, n)) for n, q in enumerate(ids)))

    rows = await pool.fetch(
        "SELECT m.id, m.received_at, count(r.id) AS n FROM message m "
        "JOIN recipient r ON r.message_id = m.id GROUP BY m.id"
    )
    assert {r["id"] for r in rows} == set(ids)
    assert all(r["n"] == 2 for r in rows)
    # received_at is the commit's transaction time: fewer distinct values than messages means
    # messages shared commits (40 messages, at most 16 per statement, two statements at once).
    assert 3 <= len({r["received_at"] for r in rows}) < 40
    assert not group._commits  # every commit task has ended


async def test_a_message_the_database_refuses_fails_alone(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A NUL in the sender is refused by PostgreSQL (a data error): its batch neighbours are
    committed one by one, and only the bad message's caller gets the error."""
    group = GroupCommit(pool, max_batch=16, max_commits=1)
    good = [new_id() for _ in range(5)]
    bad = new_id()
    first = asyncio.ensure_future(group.enqueue(new_id(), envelope(org_id, 99)))
    # These wait for the first commit and then go together in one batch.
    outcomes = await asyncio.gather(
        *(group.enqueue(q, envelope(org_id, n)) for n, q in enumerate(good)),
        group.enqueue(bad, envelope(org_id, 7, sender="bad\x00sender@example.com")),
        return_exceptions=True,
    )
    await first

    assert outcomes[:5] == [None] * 5
    assert isinstance(outcomes[5], asyncpg.DataError)
    queued = {r["id"] for r in await pool.fetch("SELECT id FROM message")}
    assert set(good) <= queued and bad not in queued
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE message_id = $1", bad) == 0


async def test_an_outage_fails_every_waiting_message_and_writes_nothing(
    db_url: str, org_id: uuid.UUID
) -> None:
    pool = await asyncpg.create_pool(db_url, min_size=1, max_size=2)
    assert pool is not None
    group = GroupCommit(pool)
    await pool.close()

    outcomes = await asyncio.gather(
        *(group.enqueue(new_id(), envelope(org_id, n)) for n in range(5)),
        return_exceptions=True,
    )

    assert all(isinstance(o, asyncpg.InterfaceError) for o in outcomes), outcomes
    check = await asyncpg.connect(db_url)
    try:
        assert await check.fetchval("SELECT count(*) FROM message") == 0
    finally:
        await check.close()


async def test_an_envelope_without_recipients_is_refused_before_any_commit(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    group = GroupCommit(pool)
    empty = Envelope(org_id=org_id, sender="", recipients=(), body=b"x", listener="relay")
    with pytest.raises(ValueError):
        await group.enqueue(new_id(), empty)
    assert not group._commits  # every commit task has ended
