"""Claims handed back unattempted because their destination had no room (rate or concurrency)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from pigeon_mta.store.queue import Executor

# Like releasing a lease, the attempt did not happen (the counter goes back down), but the row is
# due only when the destination should have room again, so the engine does not claim it at once.
_POSTPONE = """
UPDATE recipient
SET status = 'queued', attempts = attempts - 1, next_attempt_at = $3, lease_until = NULL,
    lease_owner = NULL, updated_at = now()
WHERE id = ANY ($1::uuid[]) AND status = 'delivering' AND lease_owner = $2
"""


async def postpone_claims(
    db: Executor, ids: Sequence[uuid.UUID], *, owner: str, until: datetime
) -> int:
    """Give claimed rows back to the queue, due at `until`, without counting an attempt."""
    tag = await db.execute(_POSTPONE, list(ids), owner, until)
    return int(tag.rsplit(" ", 1)[-1])
