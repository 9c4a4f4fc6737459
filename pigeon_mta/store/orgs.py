"""Tenants: the org table."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id
from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class Org:
    id: uuid.UUID
    name: str
    created_at: datetime
    rate: float = 0.0  # messages per second for the whole cluster (0: no limit)


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
    rows = await db.fetch("SELECT id, name, created_at, rate FROM org ORDER BY name")
    return [Org(r["id"], r["name"], r["created_at"], r["rate"]) for r in rows]


async def set_org_rate(db: Executor, name: str, rate: float) -> Org | None:
    """Set an org's rate (its budget, store/budgets.py); None when there is no such org."""
    row = await db.fetchrow(
        "UPDATE org SET rate = $2 WHERE name = $1 RETURNING id, name, created_at, rate",
        name,
        float(rate),
    )
    return Org(row["id"], row["name"], row["created_at"], row["rate"]) if row else None


# ---------------------------------------------------------------- removal


@dataclass(frozen=True)
class OrgRemoval:
    """What removing an org deleted (or, when it was refused, found waiting)."""

    org: Org
    waiting: int  # recipients queued or being delivered when it was removed
    users: int
    domains: int
    dkim_keys: int
    suppressions: int
    messages: int


class OrgBusy(Exception):
    """The org still has mail waiting or in flight (OrgRemoval.waiting) and force was not given."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"{waiting} recipient(s) queued or being delivered")
        self.waiting = waiting


# Statements in the order foreign keys need, each reached through an index: message by
# message_org_received, recipient by recipient_message, attempt by attempt_recipient.
_WAITING = """
SELECT count(*) FROM recipient
WHERE message_id IN (SELECT id FROM message WHERE org_id = $1)
  AND status IN ('queued', 'delivering')
"""
_REMOVE = (
    "DELETE FROM suppression WHERE org_id = $1",
    """DELETE FROM attempt WHERE recipient_id IN (
           SELECT r.id FROM recipient r JOIN message m ON m.id = r.message_id
           WHERE m.org_id = $1)""",
    "DELETE FROM message WHERE org_id = $1",  # recipients go with their message (ON DELETE CASCADE)
    "DELETE FROM dkim_key WHERE org_id = $1",
    "DELETE FROM sender_domain WHERE org_id = $1",
    "DELETE FROM credential WHERE org_id = $1",
    # Webhook events have no foreign key (migration 0020): reached through their webhooks.
    """DELETE FROM webhook_event WHERE webhook_id IN (
           SELECT id FROM webhook WHERE org_id = $1)""",
    "DELETE FROM webhook WHERE org_id = $1",
)


async def remove_org(db: asyncpg.Connection, name: str, *, force: bool) -> OrgRemoval | None:
    """Delete an org and everything it owns, in one transaction; None when there is no such org.

    Raises OrgBusy when recipients are queued or being delivered, unless `force`: then they are
    deleted with the rest and never delivered (a delivery in progress at that moment may still
    reach its recipient; the worker's late record then finds no row to update).
    """
    async with db.transaction():
        row = await db.fetchrow(
            "SELECT id, name, created_at FROM org WHERE name = $1 FOR UPDATE", name
        )
        if row is None:
            return None
        org = Org(row["id"], row["name"], row["created_at"])
        waiting = int(await db.fetchval(_WAITING, org.id))
        if waiting and not force:
            raise OrgBusy(waiting)
        counts = [int((await db.execute(statement, org.id)).split()[-1]) for statement in _REMOVE]
        await db.execute("DELETE FROM org WHERE id = $1", org.id)
    suppressions, _attempts, messages, keys, domains, users = counts[:6]
    return OrgRemoval(org, waiting, users, domains, keys, suppressions, messages)
