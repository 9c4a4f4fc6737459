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

_POSTPONE_FENCED = """
UPDATE recipient r
SET status = 'queued', attempts = r.attempts - 1, next_attempt_at = $3, lease_until = NULL,
    lease_owner = NULL, updated_at = now()
FROM unnest($1::uuid[], $4::int[]) AS v (id, attempt)
WHERE r.id = v.id AND r.attempts = v.attempt AND r.status = 'delivering' AND r.lease_owner = $2
"""


async def postpone_claims(
    db: Executor,
    ids: Sequence[uuid.UUID],
    *,
    owner: str,
    until: datetime,
    attempts: Sequence[int] | None = None,
) -> int:
    """Give claimed rows back to the queue, due at `until`, without counting an attempt.

    With `attempts` (each claim's attempt number), only those very claims are postponed.
    """
    if attempts is not None:
        tag = await db.execute(_POSTPONE_FENCED, list(ids), owner, until, list(attempts))
        return int(tag.rsplit(" ", 1)[-1])
    tag = await db.execute(_POSTPONE, list(ids), owner, until)
    return int(tag.rsplit(" ", 1)[-1])
