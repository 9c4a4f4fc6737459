"""The submission path's enqueue with duplicate detection (store/duplicates.py), on a real
PostgreSQL: the decision is made inside the commit, so parallel commits and batches agree."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import asyncpg

from pigeon_mta.config import Duration, RetentionSettings, Settings
from pigeon_mta.ids import new_id
from pigeon_mta.maintenance import Maintenance
from pigeon_mta.model import Envelope
from pigeon_mta.store.duplicates import enqueue_submitted
from pigeon_mta.store.group_commit import GroupCommit


def envelope(
    org_id: uuid.UUID, recipients: tuple[str, ...], message_id: str | None = "m-1@app.example"
) -> Envelope:
    return Envelope(
        org_id=org_id,
        sender="app@app.example",
        recipients=recipients,
        body=f"Message-ID: <{message_id}>\r\nSubject: hi\r\n\r\nhello\r\n".encode(),
        listener="relay",
        header_message_id=message_id,
        client_ip="127.0.0.1",
        duplicate_window=3600.0 if message_id else 0.0,
    )


async def queued(pool: asyncpg.Pool) -> dict[uuid.UUID, list[str]]:
    rows = await pool.fetch(
        "SELECT message_id, array_agg(address ORDER BY address) AS a FROM recipient "
        "GROUP BY message_id"
    )
    return {r["message_id"]: list(r["a"]) for r in rows}


async def test_a_commit_waits_for_a_parallel_one_with_the_same_message_and_finds_it(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """The second statement blocks on the first one's uncommitted entries; once the first
    commits, the second finds them and queues nothing."""
    first, second = new_id(), new_id()
    message = envelope(org_id, ("bob@example.net", "carol@example.org"))
    holder = await asyncpg.connect(db_url)
    other = await asyncpg.connect(db_url)
    try:
        transaction = holder.transaction()
        await transaction.start()
        assert (await enqueue_submitted(holder, [(first, message)])).duplicates == {}
        waiting = asyncio.ensure_future(enqueue_submitted(other, [(second, message)]))
        other_pid = other.get_server_pid()
        for _ in range(500):  # bounded: until the second statement waits on the first's lock
            if await pool.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", other_pid
            ):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the second commit never waited for the first")
        assert not waiting.done()
        await transaction.commit()
        found = (await asyncio.wait_for(waiting, 30)).duplicates
    finally:
        await holder.close()
        await other.close()

    assert set(found) == {second}
    assert found[second].reply_id == first
    assert found[second].originals == {"bob@example.net": first, "carol@example.org": first}
    assert await queued(pool) == {first: ["bob@example.net", "carol@example.org"]}


async def test_the_same_message_twice_in_one_group_commit_is_queued_once(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """Messages that share a statement: the one received first (smaller id) queues the
    recipient, a later one is its duplicate; messages without a key pass through untouched."""
    one, two, three, plain = sorted(new_id() for _ in range(4))
    enqueued = await enqueue_submitted(
        pool,
        [
            (one, envelope(org_id, ("bob@example.net",))),
            (two, envelope(org_id, ("BOB@example.net",))),
            (three, envelope(org_id, ("bob@example.net", "dave@example.org"))),
            (plain, envelope(org_id, ("bob@example.net",), message_id=None)),
        ],
    )
    found = enqueued.duplicates

    assert set(found) == {two, three}
    assert found[two].reply_id == one and found[two].originals == {"BOB@example.net": one}
    assert found[three].reply_id == three and found[three].originals == {"bob@example.net": one}
    assert await queued(pool) == {
        one: ["bob@example.net"],
        three: ["dave@example.org"],
        plain: ["bob@example.net"],
    }
    records = await pool.fetch(
        "SELECT original_id, reply_id, address FROM duplicate_reception ORDER BY address"
    )
    assert [tuple(r) for r in records] == [
        (one, one, "BOB@example.net"),
        (one, three, "bob@example.net"),
    ]


async def test_group_commit_hands_each_caller_its_own_duplicates(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    group = GroupCommit(pool, max_batch=16, max_commits=1)
    ids = [new_id() for _ in range(6)]
    outcomes = await asyncio.gather(
        *(group.enqueue(q, envelope(org_id, ("bob@example.net",))) for q in ids)
    )
    # The first statement holds the first caller alone; the rest wait and share the next one.
    assert outcomes[0] is None
    assert all(o is not None and o.reply_id == ids[0] for o in outcomes[1:])
    assert await queued(pool) == {ids[0]: ["bob@example.net"]}


async def test_maintenance_prunes_ended_windows_and_old_duplicate_receptions(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    first, second = new_id(), new_id()
    await enqueue_submitted(pool, [(first, envelope(org_id, ("bob@example.net",)))])
    await enqueue_submitted(pool, [(second, envelope(org_id, ("bob@example.net",)))])
    settings = dataclasses.replace(Settings(), retention=RetentionSettings(messages=Duration(3600)))

    await Maintenance(settings, pool).sweep_once()
    assert await pool.fetchval("SELECT count(*) FROM submission_dedup") == 1
    assert await pool.fetchval("SELECT count(*) FROM duplicate_reception") == 1

    # The window ended, and the duplicate is older than the retention: both go.
    await pool.execute("UPDATE submission_dedup SET expires_at = now() - interval '1 second'")
    await pool.execute(
        "UPDATE duplicate_reception SET id = $1, received_at = now() - interval '2 hours'",
        uuid.UUID(int=0x7 << 76),  # a UUIDv7 of 1970, below any cutoff
    )
    await Maintenance(settings, pool).sweep_once()
    assert await pool.fetchval("SELECT count(*) FROM submission_dedup") == 0
    assert await pool.fetchval("SELECT count(*) FROM duplicate_reception") == 0
