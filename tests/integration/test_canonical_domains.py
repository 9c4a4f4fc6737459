"""Sender domains in one spelling: written so by the store, kept so by the database, and brought
to it by migration 0015 where a hand-written row was not."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from pigeon_mta.ids import new_id
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store.migrate import available_migrations, migrate


@pytest.fixture
async def empty_db(admin_url: str) -> AsyncIterator[str]:
    name = f"pigeon_canon_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    parts = urlsplit(admin_url)
    yield urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


async def test_the_store_writes_a_sender_domain_in_a_labels(pool: asyncpg.Pool) -> None:
    org_id = await store_orgs.ensure_org(pool, "acme")
    added = await store_domains.add_sender_domain(pool, org_id, "Bücher.Example")
    assert added.domain == "xn--bcher-kva.example"
    assert await store_domains.org_may_send_as(pool, org_id, "xn--bcher-kva.example")
    with pytest.raises(ValueError, match="not a domain name"):
        await store_domains.add_sender_domain(pool, org_id, "example.com.")


@pytest.mark.parametrize("spelling", ["bücher.example", "example.com.", " example.com"])
async def test_the_database_refuses_another_spelling(pool: asyncpg.Pool, spelling: str) -> None:
    org_id = await store_orgs.ensure_org(pool, "acme")
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(
            "INSERT INTO sender_domain (id, org_id, domain) VALUES ($1, $2, $3)",
            new_id(),
            org_id,
            spelling,
        )


async def test_migration_0015_brings_hand_written_rows_to_the_spelling(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        await conn.execute(
            "CREATE TABLE schema_migration (version integer PRIMARY KEY, name text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for migration in available_migrations():
            if migration.version < 15:
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migration (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
        org_id = new_id()
        await conn.execute("INSERT INTO org (id, name) VALUES ($1, 'acme')", org_id)
        for domain in ("example.com.", " spaced.example ", "taken.example", "taken.example."):
            await conn.execute(
                "INSERT INTO sender_domain (id, org_id, domain) VALUES ($1, $2, $3)",
                new_id(),
                org_id,
                domain,
            )
        applied = [m.version for m in await migrate(conn)]
        assert applied[0] == 15, applied  # and the later ones, which know nothing of domains
        stored = await conn.fetch("SELECT domain FROM sender_domain ORDER BY domain")
    finally:
        await conn.close()
    # A spelling already taken stays as it was, for the operator to remove.
    assert [r["domain"] for r in stored] == [
        "example.com",
        "spaced.example",
        "taken.example",
        "taken.example.",
    ]
