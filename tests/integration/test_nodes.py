"""Node runs against a real PostgreSQL: who may take a node name, and whose leases a start frees.

The double delivery these guard against: two nodes configured with one node_name; the second one's
start freed the first one's claim while it was mid-DATA, and the message went out twice.
"""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from pigeon_mta.node import STALE_AFTER, NodeRun
from pigeon_mta.store import leases, nodes
from tests.integration.queue_helpers import bulk_queue, claim


async def take(
    pool: asyncpg.Pool, run: NodeRun, known_dead_run: str = ""
) -> nodes.NodeHolder | None:
    return await nodes.take_node_name(
        pool,
        name=run.name,
        run_id=run.run_id,
        host="host-of-" + run.run_id,
        pid=4242,
        stale_after=STALE_AFTER,
        known_dead_run=known_dead_run,
    )


async def claim_two(pool: asyncpg.Pool, owner: str) -> None:
    assert len(await claim(pool, owner=owner, lease=3600, batch=2)) == 2


async def free(pool: asyncpg.Pool, name: str) -> int:
    return await leases.free_leases_of_gone_runs(pool, node_name=name, stale_after=STALE_AFTER)


async def owners(pool: asyncpg.Pool) -> list[tuple[str, str | None]]:
    rows = await pool.fetch("SELECT status, lease_owner FROM recipient")
    return sorted((r["status"], r["lease_owner"]) for r in rows)


async def heartbeat_goes_stale(pool: asyncpg.Pool, run: NodeRun) -> None:
    """What the database shows once a dead run has not beaten for longer than the bound."""
    await pool.execute(
        "UPDATE node SET heartbeat_at = now() - make_interval(secs => $2) WHERE run_id = $1",
        run.run_id,
        STALE_AFTER + 1,
    )


async def test_a_live_runs_lease_is_not_freed_when_another_run_of_its_name_starts(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=2)
    first = NodeRun("mta1")
    assert await take(pool, first) is None
    await claim_two(pool, first.lease_owner)  # mid-DATA, say

    second = NodeRun("mta1")
    holder = await take(pool, second)
    assert holder is not None
    assert (holder.run_id, holder.host, holder.pid) == (
        first.run_id,
        f"host-of-{first.run_id}",
        4242,
    )
    assert holder.heartbeat_age < STALE_AFTER
    # Even a start that went ahead anyway frees nothing a live run holds.
    assert await free(pool, "mta1") == 0
    assert await owners(pool) == [("delivering", first.lease_owner)] * 2
    assert await nodes.beat(pool, name="mta1", run_id=first.run_id)


async def test_a_dead_runs_leases_are_freed_by_the_run_that_takes_its_name(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=4)
    dead, other_node = NodeRun("mta1"), NodeRun("mta2")
    assert await take(pool, dead) is None
    assert await take(pool, other_node) is None
    await claim_two(pool, dead.lease_owner)
    await claim_two(pool, other_node.lease_owner)
    await heartbeat_goes_stale(pool, dead)

    successor = NodeRun("mta1")
    assert await take(pool, successor) is None
    assert await free(pool, "mta1") == 2
    assert await owners(pool) == [
        ("delivering", other_node.lease_owner),
        ("delivering", other_node.lease_owner),
        ("queued", None),
        ("queued", None),
    ]
    lost = await pool.fetch("SELECT response FROM attempt")
    assert [r["response"].startswith(f"lease of {dead.lease_owner} ended") for r in lost] == [
        True,
        True,
    ]
    # The dead run, were it only stalled, learns that it lost its name at its next beat.
    assert not await nodes.beat(pool, name="mta1", run_id=dead.run_id)
    assert await nodes.beat(pool, name="mta1", run_id=successor.run_id)


async def test_a_clean_stop_or_a_run_known_dead_gives_the_name_up_at_once(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    await bulk_queue(pool, org_id, messages=2)
    stopped = NodeRun("mta1")
    assert await take(pool, stopped) is None
    await nodes.mark_stopped(pool, name="mta1", run_id=stopped.run_id)
    crashed = NodeRun("mta1")
    assert await take(pool, crashed) is None
    await claim_two(pool, crashed.lease_owner)

    # Its heartbeat is fresh, but the starter holds the data_dir lock that run held.
    restarted = NodeRun("mta1")
    assert await take(pool, NodeRun("mta1"), known_dead_run=stopped.run_id) is not None
    assert await take(pool, restarted, known_dead_run=crashed.run_id) is None
    assert await free(pool, "mta1") == 2
    assert await owners(pool) == [("queued", None)] * 2


async def test_two_runs_starting_together_get_the_name_once(pool: asyncpg.Pool) -> None:
    runs = [NodeRun("mta1") for _ in range(8)]
    refused = await asyncio.gather(*(take(pool, run) for run in runs))
    assert sum(holder is None for holder in refused) == 1
    winner = runs[refused.index(None)]
    assert {holder.run_id for holder in refused if holder is not None} == {winner.run_id}


async def test_only_the_leases_of_the_named_node_with_a_run_id_are_freed(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """ "mta" must not free "mta1/..." nor "mta/x" of another name; a bare owner (written before
    owners named a run) is left to the lease sweeper."""
    await bulk_queue(pool, org_id, messages=6)
    await claim_two(pool, "mta1/aaaaaaaaaaaa")
    await claim_two(pool, "mta")
    await claim_two(pool, "mta/bbbbbbbbbbbb")  # a run of "mta" with no row: gone
    assert await take(pool, NodeRun("mta")) is None
    assert await free(pool, "mta") == 2
    assert await owners(pool) == [
        ("delivering", "mta"),
        ("delivering", "mta"),
        ("delivering", "mta1/aaaaaaaaaaaa"),
        ("delivering", "mta1/aaaaaaaaaaaa"),
        ("queued", None),
        ("queued", None),
    ]
