"""Migrations: idempotent, recorded, safe when two nodes run them at once."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from pigeon_mta.store.migrate import available_migrations, migrate
from tests.conftest import run_pigeon


@pytest.fixture
async def empty_db(admin_url: str) -> AsyncIterator[str]:
    name = f"pigeon_empty_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    parts = urlsplit(admin_url)
    yield urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


async def test_migrate_is_idempotent(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        first = await migrate(conn)
        assert [m.version for m in first] == [m.version for m in available_migrations()]
        assert await migrate(conn) == []
        recorded = await conn.fetch("SELECT version FROM schema_migration ORDER BY version")
        assert [r["version"] for r in recorded] == [m.version for m in available_migrations()]
    finally:
        await conn.close()


async def test_two_concurrent_migrations_are_safe(empty_db: str) -> None:
    conns = [await asyncpg.connect(empty_db) for _ in range(2)]
    try:
        applied = await asyncio.gather(*(migrate(c) for c in conns))
        assert sorted(len(a) for a in applied) == [0, len(available_migrations())]
        assert await conns[0].fetchval("SELECT count(*) FROM schema_migration") == len(
            available_migrations()
        )
        assert await conns[0].fetchval("SELECT to_regclass('recipient') IS NOT NULL")
    finally:
        for c in conns:
            await c.close()


def test_migrate_command_twice(empty_db: str) -> None:
    env = {"PIGEON_DATABASE_URL": empty_db}
    first = run_pigeon("migrate", "--json", env=env)
    assert first.returncode == 0, first.stderr
    second = run_pigeon("migrate", "--json", env=env)
    assert second.returncode == 0, second.stderr
    assert '"pending": 0' in second.stdout
