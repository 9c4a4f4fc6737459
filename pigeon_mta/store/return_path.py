"""Return-path domains and the keys of their VERP tokens (feedback/tokens.py makes and reads the
tokens; this module keeps the keys).

A sender domain's `return_path` (else `[bounces] return_path_domain`) is the domain its mail
leaves with as envelope sender, one address per recipient: the claim returns it with each row
(store/claims.py). The newest key that is not retired signs; `rotate_key` retires it and makes
the next; a retired key verifies for `max_age` more, then it is deleted.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from pigeon_mta.domains import normalize_domain
from pigeon_mta.store.executor import Executor


@dataclass(frozen=True)
class StoredKey:
    id: int  # 0..255: the token's key byte (feedback/tokens.py)
    secret: bytes


@dataclass(frozen=True)
class Keys:
    signing: StoredKey
    verifying: dict[int, StoredKey]  # the signing key and the retired ones still in force


# The next key byte: one past the newest key's (0..255, round), skipping any still in use.
_ADD_KEY = """
WITH taken AS (SELECT id FROM return_path_key),
     nxt AS (
        SELECT n FROM generate_series(0, 255) AS g (n)
        WHERE n NOT IN (SELECT id FROM taken)
        ORDER BY (n - COALESCE((SELECT id FROM return_path_key ORDER BY created_at DESC, id DESC
                                LIMIT 1), -1) + 255) % 256
        LIMIT 1)
INSERT INTO return_path_key (id, secret) SELECT n, $1 FROM nxt
RETURNING id, secret
"""


async def keys(db: Executor, *, max_age: float) -> Keys:
    """The signing key (made on first use) and every key that still verifies. Retired keys older
    than `max_age` past their retirement are deleted on the way."""
    await db.execute(
        "DELETE FROM return_path_key WHERE retired_at < now() - make_interval(secs => $1)",
        float(max_age),
    )
    rows = await db.fetch(
        "SELECT id, secret, retired_at FROM return_path_key ORDER BY created_at, id"
    )
    current = [r for r in rows if r["retired_at"] is None]
    if not current:
        await db.execute("SELECT pg_advisory_xact_lock(hashtext('pigeon return_path_key'))")
        row = await db.fetchrow(
            "SELECT id, secret FROM return_path_key WHERE retired_at IS NULL"
            " ORDER BY created_at DESC, id DESC LIMIT 1"
        )
        if row is None:
            row = await db.fetchrow(_ADD_KEY, secrets.token_bytes(32))
        assert row is not None
        rows = [*rows, row]
        signing = StoredKey(row["id"], bytes(row["secret"]))
    else:
        signing = StoredKey(current[-1]["id"], bytes(current[-1]["secret"]))
    verifying = {r["id"]: StoredKey(r["id"], bytes(r["secret"])) for r in rows}
    return Keys(signing, verifying)


async def rotate_key(db: Executor) -> int:
    """Retire the signing key and make a new one; returns the new key's byte."""
    await db.execute("SELECT pg_advisory_xact_lock(hashtext('pigeon return_path_key'))")
    await db.execute("UPDATE return_path_key SET retired_at = now() WHERE retired_at IS NULL")
    row = await db.fetchrow(_ADD_KEY, secrets.token_bytes(32))
    if row is None:
        raise RuntimeError("all 256 key bytes are in use: wait for retired keys to expire")
    return int(row["id"])


async def set_return_path(db: Executor, domain: str, return_path: str | None) -> bool:
    """Give a sender domain its return-path domain (None: the default again); False when the
    sender domain is not known. Raises ValueError for a return path that is no host name."""
    name = normalize_domain(domain)
    value = None
    if return_path:
        value = normalize_domain(return_path)
        if value is None:
            raise ValueError(f"'{return_path}' is not a domain name")
    result = await db.execute(
        "UPDATE sender_domain SET return_path = $2 WHERE domain = $1", name, value
    )
    return result.endswith(" 1")


async def return_path_domains(db: Executor, default: str) -> set[str]:
    """Every domain the feedback listener takes mail for: the default and each sender domain's."""
    rows = await db.fetch(
        "SELECT DISTINCT return_path FROM sender_domain WHERE return_path IS NOT NULL"
    )
    found = {r["return_path"] for r in rows}
    if default:
        found.add(default)
    return found
