"""Idempotency keys of the HTTP API: the idempotency_key table (migration 0021 says why its row
is written before the message is queued)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pigeon_mta.store.executor import Executor, transaction

# How long a key is remembered.
TTL = 24 * 3600.0
# Expired rows of other keys a claim deletes in passing.
_PRUNE = 100


@dataclass(frozen=True)
class Remembered:
    request_hash: bytes
    queue_id: uuid.UUID
    status: int | None  # None until the first request has been answered
    response: bytes | None


_FIND = """
SELECT request_hash, queue_id, status, response FROM idempotency_key
WHERE org_id = $1 AND key = $2 AND created_at > now() - make_interval(secs => $3)
"""

# Pruning skips rows that other claims hold, so that it never waits.
_PRUNE_EXPIRED = """
DELETE FROM idempotency_key WHERE (org_id, key) IN (
    SELECT org_id, key FROM idempotency_key
    WHERE created_at <= now() - make_interval(secs => $3)
      AND NOT (org_id = $1 AND key = $2)
    LIMIT $4 FOR UPDATE SKIP LOCKED)
"""

_CLAIM = """
INSERT INTO idempotency_key AS k (org_id, key, request_hash, queue_id) VALUES ($1, $2, $3, $4)
ON CONFLICT (org_id, key) DO UPDATE
    SET request_hash = $3, queue_id = $4, created_at = now(), status = NULL, response = NULL
    WHERE k.created_at <= now() - make_interval(secs => $5)
RETURNING queue_id
"""


async def find(db: Executor, org_id: uuid.UUID, key: str) -> Remembered | None:
    """What the org's `key` was used for within the TTL, or None."""
    row = await db.fetchrow(_FIND, org_id, key, TTL)
    if row is None:
        return None
    return Remembered(
        bytes(row["request_hash"]),
        row["queue_id"],
        row["status"],
        bytes(row["response"]) if row["response"] is not None else None,
    )


async def claim(
    db: Executor, org_id: uuid.UUID, key: str, request_hash: bytes, queue_id: uuid.UUID
) -> Remembered | None:
    """Take `key` for a request about to queue `queue_id`: None when it is ours, else what a
    request that took it first (and still holds it, within the TTL) remembered."""
    async with transaction(db) as conn:
        await conn.execute(_PRUNE_EXPIRED, org_id, key, TTL, _PRUNE)
        taken = await conn.fetchval(_CLAIM, org_id, key, request_hash, queue_id, TTL)
        if taken is not None:
            return None
        return await find(conn, org_id, key)


async def remember_answer(
    db: Executor, org_id: uuid.UUID, key: str, queue_id: uuid.UUID, status: int, response: bytes
) -> None:
    await db.execute(
        """UPDATE idempotency_key SET status = $4, response = $5
           WHERE org_id = $1 AND key = $2 AND queue_id = $3""",
        org_id,
        key,
        queue_id,
        status,
        response,
    )
