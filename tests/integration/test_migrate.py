"""Migrations: idempotent, recorded, safe when two nodes run them at once."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from pigeon_mta.store import migrate as migrate_module
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


async def test_an_index_build_on_a_large_table_is_not_cut_short_by_the_statement_timeout(
    empty_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` migrates on the service's connection settings. Upgrading a database whose queue
    holds 200,000 recipients, the index that 0009 builds reads them all: the statement timeout
    meant for queue queries (here 10 ms) must not cancel it, and the session keeps its timeout."""
    every = available_migrations()
    before = [m for m in every if m.version < 9]  # 0009 builds recipient_warn_due
    monkeypatch.setattr(migrate_module, "available_migrations", lambda: before)
    conn = await asyncpg.connect(empty_db)
    try:
        await migrate(conn)
        await conn.execute(
            """INSERT INTO org (id, name) VALUES (gen_random_uuid(), 'big');
               INSERT INTO message (id, org_id, sender, size, body, listener)
               SELECT gen_random_uuid(), id, 'a@example.com', 1, 'x', 'test' FROM org;
               INSERT INTO recipient (id, message_id, org_id, address, domain, status, created_at,
                                      next_attempt_at, attempts)
               SELECT gen_random_uuid(), m.id, m.org_id, 'r' || n || '@example.net',
                      'example.net', 'delivered', now(), now(), 1
               FROM message m, generate_series(1, 200000) AS n"""
        )
    finally:
        await conn.close()
    monkeypatch.undo()
    conn = await asyncpg.connect(empty_db, server_settings={"statement_timeout": "10"})
    try:
        applied = [m.version for m in await migrate(conn)]
        assert applied == [m.version for m in every if m.version >= 9]
        assert await conn.fetchval("SHOW statement_timeout") == "10ms"
    finally:
        await conn.close()
