"""Tenants: the org table."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from pigeon_mta.ids import new_id
from pigeon_mta.store.queue import Executor


@dataclass(frozen=True)
class Org:
    id: uuid.UUID
    name: str
    created_at: datetime


class OrgExists(Exception):
    pass


async def add_org(db: Executor, name: str) -> Org:
    row = await db.fetchrow(
        """INSERT INTO org (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING
           RETURNING id, name, created_at""",
        new_id(),
        name,
    )
    if row is None:
        raise OrgExists(f"org '{name}' already exists")
    return Org(row["id"], row["name"], row["created_at"])


async def ensure_org(db: Executor, name: str) -> uuid.UUID:
    """The id of org `name`, created if missing (safe when several nodes start together)."""
    await db.execute(
        "INSERT INTO org (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING", new_id(), name
    )
    org_id = await db.fetchval("SELECT id FROM org WHERE name = $1", name)
    assert isinstance(org_id, uuid.UUID)
    return org_id


async def find_org(db: Executor, name: str) -> Org | None:
    row = await db.fetchrow("SELECT id, name, created_at FROM org WHERE name = $1", name)
    return Org(row["id"], row["name"], row["created_at"]) if row else None


async def org_name(db: Executor, org_id: uuid.UUID) -> str | None:
    name = await db.fetchval("SELECT name FROM org WHERE id = $1", org_id)
    return name if isinstance(name, str) else None


async def list_orgs(db: Executor) -> list[Org]:
    rows = await db.fetch("SELECT id, name, created_at FROM org ORDER BY name")
    return [Org(r["id"], r["name"], r["created_at"]) for r in rows]
