"""The suppression list: per-org addresses that must not be mailed (from hard bounces or by hand).

Addresses are compared in lower case (the table holds them so): a bounce for Bob@Example.net
suppresses bob@example.net too. An entry may carry an expiry; an expired entry is ignored by every
check and replaced by the next bounce or `suppress add`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id, new_ids
from pigeon_mta.store.executor import Executor

MANUAL = "manual"
BOUNCE = "bounce"
COMPLAINT = "complaint"  # a complaint report (store/feedback.py)

# A suppression-list entry `s` in force: this module owns the list; the claim
# (store/claims.py) and the queue views read it.
SUPPRESSION_ACTIVE = "(s.expires_at IS NULL OR s.expires_at > now())"


@dataclass(frozen=True)
class Suppression:
    id: uuid.UUID
    org_id: uuid.UUID
    address: str
    reason: str
    source: str  # "bounce" or "manual"
    attempt_id: uuid.UUID | None
    created_at: datetime
    expires_at: datetime | None


def normalise_address(address: str) -> str:
    """An address as typed, without white space and angle brackets around it. The list keys on
    its `lower()` made by PostgreSQL, in every statement that writes or reads it (the claim too):
    one lowercasing, whatever the database's locale does to letters outside ASCII."""
    return address.strip().strip("<>").strip()


_COLUMNS = "id, org_id, address, reason, source, attempt_id, created_at, expires_at"


def _entry(row: asyncpg.Record) -> Suppression:
    return Suppression(
        id=row["id"],
        org_id=row["org_id"],
        address=row["address"],
        reason=row["reason"],
        source=row["source"],
        attempt_id=row["attempt_id"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
    )


# ---------------------------------------------------------------- by hand

# A manual entry replaces whatever was there: the operator's word is the latest.
_ADD = f"""
INSERT INTO suppression (id, org_id, address, reason, source, attempt_id, expires_at)
VALUES ($1, $2, lower($3), $4, $5, $6, $7)
ON CONFLICT (org_id, address) DO UPDATE
SET reason = EXCLUDED.reason, source = EXCLUDED.source, attempt_id = EXCLUDED.attempt_id,
    created_at = now(), expires_at = EXCLUDED.expires_at
RETURNING {_COLUMNS}, (xmax = 0) AS inserted
"""


async def add_suppression(
    db: Executor,
    org_id: uuid.UUID,
    address: str,
    *,
    reason: str,
    source: str = MANUAL,
    attempt_id: uuid.UUID | None = None,
    expires_at: datetime | None = None,
) -> tuple[Suppression, bool]:
    """Suppress `address` for the org; returns the entry and whether it is new (else updated)."""
    row = await db.fetchrow(
        _ADD,
        new_id(),
        org_id,
        normalise_address(address),
        reason,
        source,
        attempt_id,
        expires_at,
    )
    assert row is not None
    return _entry(row), bool(row["inserted"])


async def remove_suppression(db: Executor, org_id: uuid.UUID, address: str) -> bool:
    """Take `address` off the org's list; False when it was not there."""
    result = await db.execute(
        "DELETE FROM suppression WHERE org_id = $1 AND address = lower($2)",
        org_id,
        normalise_address(address),
    )
    return result.endswith(" 1")


async def list_suppressions(
    db: Executor,
    org_id: uuid.UUID | None = None,
    *,
    include_expired: bool = False,
    limit: int | None = None,
) -> list[Suppression]:
    """The org's entries (every org's with org_id None), newest first."""
    rows = await db.fetch(
        f"""SELECT {_COLUMNS} FROM suppression
            WHERE ($1::uuid IS NULL OR org_id = $1)
              AND ($2 OR expires_at IS NULL OR expires_at > now())
            ORDER BY created_at DESC, address
            LIMIT $3""",
        org_id,
        include_expired,
        limit,
    )
    return [_entry(r) for r in rows]


async def find_suppression(db: Executor, org_id: uuid.UUID, address: str) -> Suppression | None:
    """The org's active entry for `address`, through the list's key (org_id, address)."""
    row = await db.fetchrow(
        f"""SELECT {_COLUMNS} FROM suppression
            WHERE org_id = $1 AND address = lower($2)
              AND (expires_at IS NULL OR expires_at > now())""",
        org_id,
        normalise_address(address),
    )
    return _entry(row) if row else None


async def page_suppressions(
    db: Executor, org_id: uuid.UUID, *, after: str | None, limit: int
) -> list[Suppression]:
    """The org's active entries in address order, those after the address `after`, at most
    `limit`: read along the list's key (org_id, address), so a page costs a page whatever the
    list's size, and entries added meanwhile never make a page repeat one."""
    rows = await db.fetch(
        f"""SELECT {_COLUMNS} FROM suppression
            WHERE org_id = $1 AND address > $2
              AND (expires_at IS NULL OR expires_at > now())
            ORDER BY address LIMIT $3""",
        org_id,
        after or "",
        limit,
    )
    return [_entry(r) for r in rows]


def looks_like_address(address: str) -> bool:
    """A local part, an @ and a domain, no white space: what the list accepts by hand."""
    local, at, domain = address.rpartition("@")
    return bool(at and local and domain) and not any(c.isspace() for c in address)


# ---------------------------------------------------------------- from bounces

# An active manual entry stays as the operator left it; a bounce entry (or an expired one) is
# refreshed by the newest bounce. DISTINCT ON: one batch may bounce the same address twice (two
# messages), and one INSERT may not update a row twice.
_FROM_BOUNCES = f"""
WITH v AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[])
        AS v (id, recipient_id, attempt, reason)
)
INSERT INTO suppression AS s (id, org_id, address, reason, source, attempt_id, expires_at)
SELECT DISTINCT ON (r.org_id, lower(r.address))
       v.id, r.org_id, lower(r.address), v.reason, '{BOUNCE}',
       (SELECT a.id FROM attempt a
        WHERE a.recipient_id = v.recipient_id AND a.attempt = v.attempt
          AND a.outcome = 'bounced' AND a.applied
        ORDER BY a.recorded_at DESC LIMIT 1),
       CASE WHEN $5 > 0 THEN now() + make_interval(secs => $5) END
FROM v JOIN recipient r ON r.id = v.recipient_id
ORDER BY r.org_id, lower(r.address), v.id DESC
ON CONFLICT (org_id, address) DO UPDATE
SET reason = EXCLUDED.reason, source = EXCLUDED.source, attempt_id = EXCLUDED.attempt_id,
    created_at = now(), expires_at = EXCLUDED.expires_at
WHERE s.source = '{BOUNCE}' OR NOT {SUPPRESSION_ACTIVE}
"""


@dataclass(frozen=True)
class BounceEntry:
    """A hard bounce whose address goes on its org's list (outbound/outcome.py decides which)."""

    recipient_id: uuid.UUID
    attempt: int  # the attempt that bounced: the entry points at its attempt-log row
    reason: str


async def suppress_bounced(
    db: Executor, entries: Sequence[BounceEntry], *, suppress_for: float = 0
) -> int:
    """Suppress the addresses of these recorded hard bounces; returns how many entries were written.

    Call it in the transaction that recorded the bounces: the entry points at the attempt that
    caused it. `suppress_for` > 0 makes entries expire after that many seconds.
    """
    if not entries:
        return 0
    rows = await db.execute(
        _FROM_BOUNCES,
        new_ids(len(entries)),
        [e.recipient_id for e in entries],
        [e.attempt for e in entries],
        [e.reason for e in entries],
        float(suppress_for),
    )
    return int(rows.rsplit(" ", 1)[-1])
