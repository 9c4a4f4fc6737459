"""Counters behind the submission limits: failed AUTH attempts per client IP, messages per credential.

Kept in the database so that every process and every node sees the same counts.
"""

from __future__ import annotations

import uuid

from pigeon_mta.ids import new_id
from pigeon_mta.store.queue import Executor

# Cross-tenant by design: a failed AUTH belongs to no org. Old rows of every client are pruned in
# the same statement (the time index keeps that cheap), so the table holds one window of failures.
_RECORD_AUTH_FAILURE = """
WITH pruned AS (
    DELETE FROM auth_failure WHERE failed_at < now() - make_interval(secs => $5)
)
INSERT INTO auth_failure (id, client_ip, username, listener) VALUES ($1, $2::inet, $3, $4)
"""


async def record_auth_failure(
    db: Executor, *, client_ip: str, username: str | None, listener: str, window: float
) -> None:
    await db.execute(_RECORD_AUTH_FAILURE, new_id(), client_ip, username, listener, float(window))


async def recent_auth_failures(db: Executor, *, client_ip: str, window: float) -> int:
    """Failed AUTH attempts from `client_ip` within the last `window` seconds."""
    count = await db.fetchval(
        """SELECT count(*) FROM auth_failure
           WHERE client_ip = $1::inet AND failed_at > now() - make_interval(secs => $2)""",
        client_ip,
        float(window),
    )
    return int(count or 0)


async def recent_messages_of_credential(
    db: Executor, credential_id: uuid.UUID, *, window: float, up_to: int
) -> int:
    """Messages the credential submitted within `window` seconds, counted up to `up_to`.

    The LIMIT keeps the cost bounded by the rate limit, whatever the history.
    """
    count = await db.fetchval(
        """SELECT count(*) FROM (
               SELECT 1 FROM message
               WHERE credential_id = $1 AND received_at > now() - make_interval(secs => $2)
               LIMIT $3) recent""",
        credential_id,
        float(window),
        up_to,
    )
    return int(count or 0)
