"""DKIM keys: the dkim_key table, and the sender-domain lookup that key management needs.

Private keys are read by exactly one query, `active_signing_keys`, which the signer uses; the
admin listings never select them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id
from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class SenderDomain:
    id: uuid.UUID
    org_id: uuid.UUID
    org_name: str
    domain: str


@dataclass(frozen=True)
class DkimKey:
    """A key as operators see it: everything but the private key."""

    id: uuid.UUID
    org_id: uuid.UUID
    org_name: str
    domain_id: uuid.UUID
    domain: str
    selector: str
    algorithm: str
    key_bits: int | None
    public_key: str
    active: bool
    created_at: datetime


@dataclass(frozen=True)
class ActiveSigningKey:
    """What the signer needs of an active key."""

    id: uuid.UUID
    domain: str
    selector: str
    algorithm: str
    private_key: str  # PEM


class SelectorExists(Exception):
    pass


_KEY_COLUMNS = """k.id, k.org_id, o.name AS org_name, k.domain_id, d.domain, k.selector,
                  k.algorithm, k.key_bits, k.public_key, k.active, k.created_at"""
_KEY_FROM = (
    """dkim_key k JOIN sender_domain d ON d.id = k.domain_id JOIN org o ON o.id = k.org_id"""
)


def _key(row: asyncpg.Record) -> DkimKey:
    return DkimKey(**dict(row))


async def find_sender_domain(db: Executor, domain: str) -> SenderDomain | None:
    """The sender domain (and its org) named `domain`, spelled as stored (domains.py).

    Looks across orgs on purpose: a domain belongs to exactly one org, and this is how an
    operator's command finds which.
    """
    row = await db.fetchrow(
        """SELECT d.id, d.org_id, o.name AS org_name, d.domain
           FROM sender_domain d JOIN org o ON o.id = d.org_id
           WHERE d.domain = $1""",
        domain,
    )
    return SenderDomain(**dict(row)) if row else None


async def add_key(
    db: Executor,
    domain: SenderDomain,
    *,
    selector: str,
    algorithm: str,
    key_bits: int | None,
    private_key: str,
    public_key: str,
) -> DkimKey:
    """Store a new key. It is active at once only if the domain has no active key of its
    algorithm yet; otherwise it waits, inactive, for `activate_key` (after its DNS record is out).
    """
    active = not await db.fetchval(
        "SELECT EXISTS (SELECT 1 FROM dkim_key WHERE domain_id = $1 AND algorithm = $2 AND active)",
        domain.id,
        algorithm,
    )
    try:
        key_id = await _insert_key(
            db, domain, selector, algorithm, key_bits, private_key, public_key, active
        )
    except asyncpg.UniqueViolationError:
        # Another key of this algorithm became active meanwhile: this one waits.
        key_id = await _insert_key(
            db, domain, selector, algorithm, key_bits, private_key, public_key, False
        )
    return await _fetch_key(db, key_id)


async def _insert_key(
    db: Executor,
    domain: SenderDomain,
    selector: str,
    algorithm: str,
    key_bits: int | None,
    private_key: str,
    public_key: str,
    active: bool,
) -> uuid.UUID:
    try:
        key_id = await db.fetchval(
            """INSERT INTO dkim_key (id, org_id, domain_id, selector, algorithm, key_bits,
                                     private_key, public_key, active)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id""",
            new_id(),
            domain.org_id,
            domain.id,
            selector,
            algorithm,
            key_bits,
            private_key,
            public_key,
            active,
        )
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name == "dkim_key_one_active":
            raise
        raise SelectorExists(
            f"{domain.domain} already has a key with selector '{selector}'"
        ) from None
    assert isinstance(key_id, uuid.UUID)
    return key_id


async def _fetch_key(db: Executor, key_id: uuid.UUID) -> DkimKey:
    row = await db.fetchrow(f"SELECT {_KEY_COLUMNS} FROM {_KEY_FROM} WHERE k.id = $1", key_id)
    assert row is not None
    return _key(row)


async def list_keys(db: Executor, org_id: uuid.UUID | None = None) -> list[DkimKey]:
    """Keys of one org, or of every org (the operator's view) when `org_id` is None."""
    rows = await db.fetch(
        f"""SELECT {_KEY_COLUMNS} FROM {_KEY_FROM}
            WHERE $1::uuid IS NULL OR k.org_id = $1
            ORDER BY d.domain, k.created_at, k.selector""",
        org_id,
    )
    return [_key(r) for r in rows]


async def activate_key(
    conn: asyncpg.Connection, domain_id: uuid.UUID, selector: str
) -> tuple[DkimKey, list[str]] | None:
    """Make this key the one that signs for its domain and algorithm; returns it and the
    selectors it replaced, or None when there is no such key. One transaction, so signers never
    see the domain with two active keys of an algorithm, nor with none."""
    async with conn.transaction():
        target = await conn.fetchrow(
            "SELECT id, algorithm FROM dkim_key WHERE domain_id = $1 AND selector = $2 FOR UPDATE",
            domain_id,
            selector,
        )
        if target is None:
            return None
        replaced = await conn.fetch(
            """UPDATE dkim_key SET active = false
               WHERE domain_id = $1 AND algorithm = $2 AND active AND id <> $3
               RETURNING selector""",
            domain_id,
            target["algorithm"],
            target["id"],
        )
        await conn.execute("UPDATE dkim_key SET active = true WHERE id = $1", target["id"])
        key = await _fetch_key(conn, target["id"])
    return key, [r["selector"] for r in replaced]


async def deactivate_key(db: Executor, domain_id: uuid.UUID, selector: str) -> DkimKey | None:
    """Stop signing with this key (its record may stay published); None when there is none."""
    key_id = await db.fetchval(
        "UPDATE dkim_key SET active = false WHERE domain_id = $1 AND selector = $2 RETURNING id",
        domain_id,
        selector,
    )
    return None if key_id is None else await _fetch_key(db, key_id)


async def active_signing_keys(
    db: Executor, org_id: uuid.UUID, domain: str
) -> list[ActiveSigningKey]:
    """The active keys of `org_id` for `domain` (spelled as stored, domains.py), RSA first.

    Filtered by org: a From: domain that belongs to another org gets no signature from here.
    """
    rows = await db.fetch(
        """SELECT k.id, d.domain, k.selector, k.algorithm, k.private_key
           FROM dkim_key k JOIN sender_domain d ON d.id = k.domain_id
           WHERE k.org_id = $1 AND d.org_id = $1 AND d.domain = $2 AND k.active
           ORDER BY k.algorithm DESC, k.created_at""",
        org_id,
        domain,
    )
    return [ActiveSigningKey(**dict(r)) for r in rows]


async def owner_signing_keys(db: Executor, domain: str) -> list[ActiveSigningKey]:
    """The active keys of whichever org owns `domain` (spelled as stored, domains.py), RSA first:
    what `relay.sign_with_owner_key` signs trusted-network mail with.

    Across orgs on purpose (a domain belongs to exactly one org, and its keys are that org's);
    the signer asks this only for mail of `relay.trusted_org` with the setting on.
    """
    rows = await db.fetch(
        """SELECT k.id, d.domain, k.selector, k.algorithm, k.private_key
           FROM dkim_key k JOIN sender_domain d ON d.id = k.domain_id
           WHERE k.org_id = d.org_id AND d.domain = $1 AND k.active
           ORDER BY k.algorithm DESC, k.created_at""",
        domain,
    )
    return [ActiveSigningKey(**dict(r)) for r in rows]
