"""API keys of the HTTP API: the api_key table, and how a key is made and found.

A key is "pgn_" and 32 random bytes (256 bits) in URL-safe base64. Only its SHA-256 is stored:
with that much entropy a fast hash leaves nothing to guess, unlike a password (scrypt in
store/credentials.py), and finding a key is one index lookup per request.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.config import API_KEY_USER_PREFIX
from pigeon_mta.ids import new_id
from pigeon_mta.store.executor import Executor

KEY_PREFIX = "pgn_"


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def auth_user_of(key_id: uuid.UUID) -> str:
    """What API mail stores as its message's auth_user: names the key, not a person."""
    return f"{API_KEY_USER_PREFIX}{key_id}"


@dataclass(frozen=True)
class ApiKey:
    id: uuid.UUID
    org_id: uuid.UUID
    org: str
    name: str
    lane: str | None
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


_COLUMNS = """k.id, k.org_id, o.name AS org, k.name, k.lane, k.created_at, k.revoked_at,
    k.last_used_at"""


def _api_key(row: asyncpg.Record) -> ApiKey:
    return ApiKey(
        id=row["id"],
        org_id=row["org_id"],
        org=row["org"],
        name=row["name"],
        lane=row["lane"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        last_used_at=row["last_used_at"],
    )


async def add_api_key(
    db: Executor, org_id: uuid.UUID, *, name: str = "", lane: str | None = None
) -> tuple[ApiKey, str]:
    """A new key of the org: its row and the key itself (which is not stored)."""
    key = generate_key()
    row = await db.fetchrow(
        f"""WITH k AS (
                INSERT INTO api_key (id, org_id, name, lane, key_hash) VALUES ($1, $2, $3, $4, $5)
                RETURNING *)
            SELECT {_COLUMNS} FROM k JOIN org o ON o.id = k.org_id""",
        new_id(),
        org_id,
        name,
        lane,
        key_hash(key),
    )
    assert row is not None
    return _api_key(row), key


async def list_api_keys(db: Executor, org_id: uuid.UUID | None = None) -> list[ApiKey]:
    rows = await db.fetch(
        f"""SELECT {_COLUMNS} FROM api_key k JOIN org o ON o.id = k.org_id
            WHERE $1::uuid IS NULL OR k.org_id = $1
            ORDER BY o.name, k.created_at""",
        org_id,
    )
    return [_api_key(r) for r in rows]


async def revoke_api_key(db: Executor, key_id: uuid.UUID) -> ApiKey | None:
    """Revoke a key (refused by every process within api.auth_cache, memo.py); None when
    there is no such key. Revoking a revoked key keeps its first revocation time."""
    row = await db.fetchrow(
        f"""WITH k AS (
                UPDATE api_key SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1
                RETURNING *)
            SELECT {_COLUMNS} FROM k JOIN org o ON o.id = k.org_id""",
        key_id,
    )
    return _api_key(row) if row else None


# last_used_at is written at most once a minute per key: a busy key must not turn every request
# into a row update.
_FIND = f"""
WITH found AS (
    SELECT id FROM api_key WHERE key_hash = $1 AND revoked_at IS NULL
), touched AS (
    UPDATE api_key SET last_used_at = now()
    WHERE id = (SELECT id FROM found)
      AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')
)
SELECT {_COLUMNS} FROM api_key k JOIN org o ON o.id = k.org_id WHERE k.id = (SELECT id FROM found)
"""


async def find_active_key(db: Executor, key: str) -> ApiKey | None:
    """The unrevoked key `key` is, or None; notes its use."""
    row = await db.fetchrow(_FIND, key_hash(key))
    return _api_key(row) if row else None
