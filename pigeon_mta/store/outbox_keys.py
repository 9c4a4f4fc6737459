"""The outboxes' idempotency keys in pigeon-mta's database (table outbox_key, migration 0030): a
key takes its queue id before its message is committed, and keeps it, so that a key is queued
once whatever crashes (outbox/relay.py says when each statement runs)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pigeon_mta.store.executor import Executor

# Of the keys asked about, those given a queue id already, and whether that message is queued.
_GIVEN = """
SELECT k.key, k.queue_id, EXISTS (SELECT FROM message m WHERE m.id = k.queue_id) AS queued
FROM outbox_key k
WHERE k.org_id = $1 AND k.outbox = $2 AND k.key = ANY ($3::text[])
"""

# Each key its queue id: the one offered, unless a relay gave it one first (then that one).
_GIVE = """
INSERT INTO outbox_key AS k (org_id, outbox, key, queue_id)
SELECT $1, $2, u.key, u.queue_id FROM unnest($3::text[], $4::uuid[]) AS u (key, queue_id)
ON CONFLICT (org_id, outbox, key) DO UPDATE SET queue_id = k.queue_id
RETURNING key, queue_id
"""

_PRUNE = """
DELETE FROM outbox_key WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM outbox_key WHERE outbox = $1 AND created_at < now() - make_interval(secs => $2)
    LIMIT $3))
"""


async def given(
    db: Executor, org_id: uuid.UUID, outbox: str, keys: Sequence[str]
) -> dict[str, tuple[uuid.UUID, bool]]:
    """{key: (queue id, queued)} of the keys that have a queue id."""
    rows = await db.fetch(_GIVEN, org_id, outbox, list(keys))
    return {r["key"]: (r["queue_id"], r["queued"]) for r in rows}


async def give(
    db: Executor, org_id: uuid.UUID, outbox: str, offered: dict[str, uuid.UUID]
) -> dict[str, uuid.UUID]:
    """{key: the queue id to queue its message under}: the offered one, or one given first."""
    rows = await db.fetch(_GIVE, org_id, outbox, list(offered), list(offered.values()))
    return {r["key"]: r["queue_id"] for r in rows}


async def prune(db: Executor, outbox: str, *, older_than: float, limit: int = 5000) -> int:
    """Forget keys given more than `older_than` seconds ago: their rows are gone from the outbox."""
    result = await db.execute(_PRUNE, outbox, older_than, limit)
    return int(result.split()[-1])
