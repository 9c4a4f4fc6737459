"""What a node does once at start, before its worker processes: migrate the schema, make the
trusted org, take the node name, and free the leases and budget slots of the node's earlier runs
(pigeon_mta/supervisor.py runs it)."""

from __future__ import annotations

import logging

import asyncpg

from pigeon_mta import node
from pigeon_mta.config import Settings
from pigeon_mta.store import budgets as store_budgets
from pigeon_mta.store import connect as store_connect
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.store import leases as store_leases
from pigeon_mta.store import migrate as store_migrate
from pigeon_mta.store import orgs as store_orgs

log = logging.getLogger("pigeon_mta.serve")


async def prepare_database(
    settings: Settings, url: str, run: node.NodeRun, lock: node.DataDirLock
) -> None:
    """Migrate, create the trusted org, take the node name, free the leases and budget slots of
    the node's earlier runs. Runs once per node start."""
    conn = await store_connect.connect(url, settings)
    try:
        applied = await store_migrate.migrate(conn)
        if applied:
            log.info("schema migrated: %s", ", ".join(f"{m.version:04d}_{m.name}" for m in applied))
        await store_orgs.ensure_org(conn, settings.relay.trusted_org)
        await warn_users_outside_lanes(conn, settings)
        await node.take_node_name(conn, run, lock)
        freed = await store_leases.free_leases_of_gone_runs(
            conn, node_name=run.name, stale_after=node.STALE_AFTER
        )
        if freed:
            log.warning(
                "freed %d recipient(s) that node %s held when it last stopped; they are due again",
                freed,
                run.name,
            )
        await store_budgets.free_slots_of_gone_runs(conn, run.name, run.lease_owner)
    finally:
        await conn.close()


async def warn_users_outside_lanes(conn: asyncpg.Connection, settings: Settings) -> None:
    """Users whose lane the settings no longer have: their mail goes to the listener's lane
    (intake/lanes.py); said once at start, so that the operator need not wait for it."""
    for lane, users in (await store_credentials.users_outside_lanes(conn, settings.lanes)).items():
        shown = ", ".join(users[:10]) + (f" and {len(users) - 10} more" if len(users) > 10 else "")
        log.warning(
            "user(s) %s have the lane '%s', which is not a lane of [lanes]: their mail goes to "
            "the listener's lane or 'transactional' (pigeon-mta user set USER --lane NAME)",
            shown,
            lane,
        )
