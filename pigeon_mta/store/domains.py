"""Sender domains: which org may send as which domain (the sender_domain table)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.domains import normalize_domain
from pigeon_mta.ids import new_id
from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class SenderDomain:
    id: uuid.UUID
    org_id: uuid.UUID
    org: str
    domain: str
    created_at: datetime
    # Where its mail's bounces return (store/return_path.py); None: [bounces] return_path_domain.
    return_path: str | None = None


class DomainTaken(Exception):
    """The domain is already added (to this org or another); a domain belongs to one org."""


async def add_sender_domain(db: Executor, org_id: uuid.UUID, name: str) -> SenderDomain:
    """Add the domain `name`, stored in the one spelling of domains.py (the signer and the sender
    policy look it up in no other); raises ValueError when it is not a host name."""
    domain = normalize_domain(name)
    if domain is None:
        raise ValueError(f"'{name}' is not a domain name")
    row = await db.fetchrow(
        """WITH d AS (
               INSERT INTO sender_domain (id, org_id, domain) VALUES ($1, $2, $3)
               ON CONFLICT (domain) DO NOTHING
               RETURNING *)
           SELECT d.id, d.org_id, o.name AS org, d.domain, d.created_at
           FROM d JOIN org o ON o.id = d.org_id""",
        new_id(),
        org_id,
        domain,
    )
    if row is None:
        owner = await db.fetchval(
            "SELECT o.name FROM sender_domain d JOIN org o ON o.id = d.org_id WHERE d.domain = $1",
            domain,
        )
        raise DomainTaken(f"domain '{domain}' is already added to org '{owner}'")
    return SenderDomain(row["id"], row["org_id"], row["org"], row["domain"], row["created_at"])


async def list_sender_domains(db: Executor) -> list[SenderDomain]:
    rows = await db.fetch(
        """SELECT d.id, d.org_id, o.name AS org, d.domain, d.created_at
           FROM sender_domain d JOIN org o ON o.id = d.org_id
           ORDER BY o.name, d.domain"""
    )
    return [
        SenderDomain(r["id"], r["org_id"], r["org"], r["domain"], r["created_at"]) for r in rows
    ]


async def find_sender_domain(db: Executor, domain: str) -> SenderDomain | None:
    row = await db.fetchrow(
        """SELECT d.id, d.org_id, o.name AS org, d.domain, d.created_at, d.return_path
           FROM sender_domain d JOIN org o ON o.id = d.org_id WHERE d.domain = $1""",
        domain,
    )
    if row is None:
        return None
    return SenderDomain(
        row["id"], row["org_id"], row["org"], row["domain"], row["created_at"], row["return_path"]
    )


async def org_may_send_as(db: Executor, org_id: uuid.UUID, domain: str) -> bool:
    """Whether `domain` (normalized) is one of the org's sender domains."""
    found = await db.fetchval(
        "SELECT EXISTS (SELECT 1 FROM sender_domain WHERE org_id = $1 AND domain = $2)",
        org_id,
        domain,
    )
    return bool(found)


@dataclass(frozen=True)
class RemovedDomain:
    domain: SenderDomain
    dkim_selectors: list[str]  # the selectors of the DKIM keys deleted with it


async def remove_sender_domain(db: asyncpg.Connection, domain: str) -> RemovedDomain | None:
    """Remove `domain` (normalized) and its DKIM keys, in one transaction; None when no org has it.

    The keys go with the domain: they sign only for it, and a private key kept for a domain no
    org may send as would be a secret with no use.
    """
    async with db.transaction():
        row = await db.fetchrow(
            """SELECT d.id, d.org_id, o.name AS org, d.domain, d.created_at
               FROM sender_domain d JOIN org o ON o.id = d.org_id
               WHERE d.domain = $1 FOR UPDATE OF d""",
            domain,
        )
        if row is None:
            return None
        selectors = await db.fetch(
            "DELETE FROM dkim_key WHERE domain_id = $1 RETURNING selector", row["id"]
        )
        await db.execute("DELETE FROM sender_domain WHERE id = $1", row["id"])
    return RemovedDomain(
        SenderDomain(row["id"], row["org_id"], row["org"], row["domain"], row["created_at"]),
        sorted(s["selector"] for s in selectors),
    )
