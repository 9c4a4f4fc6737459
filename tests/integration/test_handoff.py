"""Mail handed to the engine as it is committed (store/group_commit.py, model.Handoff), on a real
PostgreSQL, a real engine and real SMTP sinks: queued already claimed, delivered without a claim,
checked against the suppression list, and left to the claim when the engine has no room."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.ids import new_id
from pigeon_mta.model import Envelope
from pigeon_mta.store.group_commit import GroupCommit
from tests.integration.outbound_helpers import attempts, running_engine, wait_final
from tests.peers.world import mail_world


def submitted(
    org_id: uuid.UUID, *recipients: str, message_id: str | None = None, window: float = 0
) -> Envelope:
    message_id = message_id or f"{uuid.uuid4()}@sender.test"
    return Envelope(
        org_id=org_id,
        sender="alice@sender.test",
        recipients=recipients,
        body=b"From: alice@sender.test\r\nMessage-ID: <%s>\r\nSubject: hi\r\n\r\nHello.\r\n"
        % message_id.encode(),
        listener="test",
        header_message_id=message_id,
        received_at=datetime.now(UTC),
        duplicate_window=window,
    )


async def rows(pool: asyncpg.Pool, queue_id: uuid.UUID) -> list[asyncpg.Record]:
    return await pool.fetch(
        "SELECT address, status, attempts, lease_owner, lease_until IS NOT NULL AS leased "
        "FROM recipient WHERE message_id = $1 ORDER BY address",
        queue_id,
    )


async def test_mail_the_engine_has_room_for_is_queued_claimed_and_delivered(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    pokes: list[int] = []
    async with mail_world(tmp_path) as world:
        world.sinks.slow_seconds = 1.0
        async with running_engine(world.settings(db_url), pool, db_url) as engine:
            group = GroupCommit(pool, engine=engine, on_queued=pokes.append)
            queue_id = new_id()
            await group.enqueue(queue_id, submitted(org_id, "slow@plain.test", "bob@plain.test"))

            # Right after the commit, before the slow peer has answered: claimed by this
            # engine, attempt 1, and no engine was woken to claim it.
            assert [tuple(r) for r in await rows(pool, queue_id)] == [
                ("bob@plain.test", "delivering", 1, engine.owner, True),
                ("slow@plain.test", "delivering", 1, engine.owner, True),
            ]
            assert pokes == []
            assert await wait_final(pool, queue_id) == {
                "bob@plain.test": "delivered",
                "slow@plain.test": "delivered",
            }
        logged = await attempts(pool, queue_id)
    assert [(a["address"], a["attempt"], a["outcome"], a["applied"]) for a in logged] == [
        ("bob@plain.test", 1, "delivered", True),
        ("slow@plain.test", 1, "delivered", True),
    ]
    assert len(world.sinks.received_by("bob@plain.test")) == 1


async def test_a_handed_off_recipient_on_the_suppression_list_is_not_mailed(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    await pool.execute(
        "INSERT INTO suppression (id, org_id, address, reason, source) "
        "VALUES ($1, $2, 'carol@plain.test', 'asked to be left alone', 'manual')",
        new_id(),
        org_id,
    )
    async with mail_world(tmp_path) as world:
        async with running_engine(world.settings(db_url), pool, db_url) as engine:
            group = GroupCommit(pool, engine=engine)
            queue_id = new_id()
            await group.enqueue(queue_id, submitted(org_id, "Carol@plain.test", "bob@plain.test"))
            assert await wait_final(pool, queue_id) == {
                "Carol@plain.test": "suppressed",
                "bob@plain.test": "delivered",
            }
        logged = {a["address"]: a for a in await attempts(pool, queue_id)}
    assert "asked to be left alone" in logged["Carol@plain.test"]["response"]
    assert world.sinks.received_by("Carol@plain.test") == []
    assert len(world.sinks.received_by("bob@plain.test")) == 1


async def test_mail_an_engine_has_no_room_for_is_queued_for_a_claim(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    """An engine that has not started (or is full, or stopping) takes nothing: the message is
    queued as usual and announced to the claimers."""
    from pigeon_mta.outbound.engine import DeliveryEngine

    pokes: list[int] = []
    async with mail_world(tmp_path) as world:
        engine = DeliveryEngine(world.settings(db_url), pool)
        group = GroupCommit(pool, engine=engine, on_queued=pokes.append)
        queue_id = new_id()
        await group.enqueue(queue_id, submitted(org_id, "bob@plain.test", "dave@plain.test"))
    assert [tuple(r) for r in await rows(pool, queue_id)] == [
        ("bob@plain.test", "queued", 0, None, False),
        ("dave@plain.test", "queued", 0, None, False),
    ]
    assert pokes == [2]


async def test_duplicates_give_their_room_back(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    """A resubmitted message is not handed off (nothing of it is queued), and the room it was
    offered returns to the engine: with room for 4 recipients, ten resubmissions of a message of
    two still leave room for a new message."""
    pokes: list[int] = []
    async with mail_world(tmp_path) as world:
        async with running_engine(world.settings(db_url, concurrency=4), pool, db_url) as engine:
            group = GroupCommit(pool, engine=engine, on_queued=pokes.append)
            first = new_id()
            message = submitted(org_id, "bob@plain.test", "dave@plain.test", window=3600)
            await group.enqueue(first, message)
            assert await wait_final(pool, first) == {
                "bob@plain.test": "delivered",
                "dave@plain.test": "delivered",
            }
            for _ in range(10):
                duplicates = await group.enqueue(new_id(), message)
                assert duplicates is not None and duplicates.reply_id == first
            fresh = new_id()
            await group.enqueue(fresh, submitted(org_id, "bob@plain.test", "dave@plain.test"))
            assert {r["status"] for r in await rows(pool, fresh)} <= {"delivering", "delivered"}
            assert await wait_final(pool, fresh) == {
                "bob@plain.test": "delivered",
                "dave@plain.test": "delivered",
            }
    assert pokes == []
    assert len(world.sinks.received_by("bob@plain.test")) == 2


async def test_a_failed_commit_gives_the_engine_its_room_back(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    """The database refuses the commits (their pool is gone): each caller gets the error, nothing
    is queued, and the room each message was offered goes back to the engine, which then takes
    the next message as it is committed."""
    async with mail_world(tmp_path) as world:
        async with running_engine(world.settings(db_url, concurrency=4), pool, db_url) as engine:
            gone = await asyncpg.create_pool(db_url, min_size=1, max_size=1)
            assert gone is not None
            await gone.close()
            broken = GroupCommit(gone, engine=engine)
            for _ in range(5):
                with pytest.raises(asyncpg.InterfaceError):
                    await broken.enqueue(
                        new_id(), submitted(org_id, "bob@plain.test", "d@plain.test")
                    )
            assert await pool.fetchval("SELECT count(*) FROM message") == 0

            queue_id = new_id()
            await GroupCommit(pool, engine=engine).enqueue(
                queue_id, submitted(org_id, "bob@plain.test", "dave@plain.test")
            )
            assert {r["status"] for r in await rows(pool, queue_id)} <= {"delivering", "delivered"}
            assert await wait_final(pool, queue_id) == {
                "bob@plain.test": "delivered",
                "dave@plain.test": "delivered",
            }


async def test_mail_of_an_org_at_its_share_of_the_engine_is_left_to_the_claim(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str, org_id: uuid.UUID
) -> None:
    """An engine of 8 slots, half of them at most for one org: org A's first four messages are
    handed to it as they are committed, A's fifth is queued (no claim takes it while A holds
    its four: their final dots wait 4 s at the sink), and another org's message is handed over
    at once. Each is read right after its own commit."""
    from pigeon_mta.store.orgs import ensure_org

    other = await ensure_org(pool, "other")
    async with mail_world(tmp_path) as world:
        world.sinks.slow_seconds = 4.0
        settings = world.settings(db_url, concurrency=8, max_org_share=0.5)
        async with running_engine(settings, pool, db_url) as engine:
            group = GroupCommit(pool, engine=engine)
            ids = [new_id() for _ in range(6)]
            handed = []
            for n, queue_id in enumerate(ids[:5]):
                await group.enqueue(queue_id, submitted(org_id, f"slow+a{n}@plain.test"))
                handed.append((await rows(pool, queue_id))[0]["lease_owner"])
            await group.enqueue(ids[5], submitted(other, "slow+b@plain.test"))
            handed.append((await rows(pool, ids[5]))[0]["lease_owner"])
            assert handed == [engine.owner] * 4 + [None, engine.owner], handed
            for queue_id in ids:
                assert set((await wait_final(pool, queue_id)).values()) == {"delivered"}
