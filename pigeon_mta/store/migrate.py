"""Schema migrations: numbered SQL files applied once each, under an advisory lock, recorded in a table.

Numbers only need to increase; gaps are fine (no 0004 was ever committed).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

log = logging.getLogger(__name__)

# An arbitrary constant naming "pigeon-mta schema migration" among advisory locks.
MIGRATION_LOCK_KEY = 0x7069_6765_6F6E  # "pigeon"

_FILE_NAME = re.compile(r"^([0-9]{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available_migrations() -> list[Migration]:
    found = []
    for entry in resources.files("pigeon_mta.store").joinpath("migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError("two migration files share a version number")
    return found


async def migrate(conn: asyncpg.Connection) -> list[Migration]:
    """Apply every migration not yet recorded; return those applied now.

    The session advisory lock makes concurrent runs (two nodes starting together) take turns: the
    second waits, then finds everything recorded and applies nothing.
    """
    applied_now: list[Migration] = []
    # The service's statement_timeout is for queue queries: a migration that builds an index reads
    # the whole table, which on a large queue takes longer, and waiting for another node's
    # migration takes as long as that. Set back when done.
    timeout = await conn.fetchval("SHOW statement_timeout")
    await conn.execute("SET statement_timeout = 0")
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    try:
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migration (
                   version     integer PRIMARY KEY,
                   name        text NOT NULL,
                   applied_at  timestamptz NOT NULL DEFAULT now())"""
        )
        done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migration")}
        for migration in available_migrations():
            if migration.version in done:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migration (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
            log.info("applied migration %04d_%s", migration.version, migration.name)
            applied_now.append(migration)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
        await conn.execute("SELECT set_config('statement_timeout', $1, false)", timeout)
    return applied_now


async def pending_migrations(conn: asyncpg.Connection) -> list[Migration]:
    exists = await conn.fetchval("SELECT to_regclass('schema_migration') IS NOT NULL")
    done: set[int] = set()
    if exists:
        done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migration")}
    return [m for m in available_migrations() if m.version not in done]
