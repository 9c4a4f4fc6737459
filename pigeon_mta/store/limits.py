"""Counters behind the submission limits: failed AUTH attempts per client IP, messages per
credential (an SMTP user or an API key).

Kept in the database so that every process and every node sees the same counts.
"""

from __future__ import annotations

import uuid

from pigeon_mta.config import API_LISTENER
from pigeon_mta.ids import new_id
from pigeon_mta.store.executor import Executor

# Cross-tenant by design: a failed AUTH belongs to no org. One statement records the failure
# (auth_failure), adds it to the IP's count (auth_throttle) and returns that count: the upsert
# locks the IP's row, so concurrent failures of one IP are counted one after another and each
# statement knows whether its failure is past the limit (a count read before the password check
# and written after it would let every failure of a parallel burst see the same low count).
# A count whose window has passed starts over at 1. Old rows of other clients are pruned in the
# same statement, skipping rows another statement holds, so that pruning never waits.
_RECORD_AUTH_FAILURE = """
WITH pruned_failures AS (
    DELETE FROM auth_failure WHERE id IN (
        SELECT id FROM auth_failure WHERE failed_at < now() - make_interval(secs => $5)
        FOR UPDATE SKIP LOCKED)
), pruned_counts AS (
    DELETE FROM auth_throttle WHERE client_ip IN (
        SELECT client_ip FROM auth_throttle
        WHERE window_start < now() - make_interval(secs => $5) AND client_ip <> $2::inet
        FOR UPDATE SKIP LOCKED)
), logged AS (
    INSERT INTO auth_failure (id, client_ip, username, listener) VALUES ($1, $2::inet, $3, $4)
)
INSERT INTO auth_throttle AS t (client_ip, failures, window_start) VALUES ($2::inet, 1, now())
ON CONFLICT (client_ip) DO UPDATE SET
    failures = CASE WHEN t.window_start < now() - make_interval(secs => $5)
                    THEN 1 ELSE t.failures + 1 END,
    window_start = CASE WHEN t.window_start < now() - make_interval(secs => $5)
                        THEN now() ELSE t.window_start END
RETURNING failures
"""


async def record_auth_failure(
    db: Executor, *, client_ip: str, username: str | None, listener: str, window: float
) -> int:
    """Record a failed AUTH; returns the failures of `client_ip` in its window, this one included."""
    count = await db.fetchval(
        _RECORD_AUTH_FAILURE, new_id(), client_ip, username, listener, float(window)
    )
    return int(count)


async def recent_auth_failures(db: Executor, *, client_ip: str, window: float) -> int:
    """Failed AUTH attempts from `client_ip` in its current window (0 once the window passed)."""
    count = await db.fetchval(
        """SELECT failures FROM auth_throttle
           WHERE client_ip = $1::inet AND window_start >= now() - make_interval(secs => $2)""",
        client_ip,
        float(window),
    )
    return int(count or 0)


async def recent_messages(
    db: Executor,
    *,
    credential_id: uuid.UUID | None = None,
    api_key_user: str | None = None,
    window: float,
    up_to: int,
) -> int:
    """Messages an SMTP credential (`credential_id`) or an API key (`api_key_user`, its
    auth_user) submitted within `window` seconds, counted up to `up_to`.

    The LIMIT keeps the cost bounded by the rate limit, whatever the history. Each kind has its
    own index; for an API key the listener is written into the statement, as a parameter would
    not match the predicate of the partial index message_api_key_received.
    """
    who: object
    if credential_id is not None:
        who, predicate = credential_id, "credential_id = $1"
    else:
        assert api_key_user is not None
        who, predicate = api_key_user, f"listener = '{API_LISTENER}' AND auth_user = $1"
    count = await db.fetchval(
        f"""SELECT count(*) FROM (
               SELECT 1 FROM message
               WHERE {predicate} AND received_at > now() - make_interval(secs => $2)
               LIMIT $3) recent""",
        who,
        float(window),
        up_to,
    )
    return int(count or 0)
