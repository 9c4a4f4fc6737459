"""SMTP AUTH credentials: the credential table, and the scrypt hashes its passwords are kept as."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import string
import unicodedata
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id
from pigeon_mta.store.executor import Executor, transaction

# scrypt cost: 2^14 x 8 x 1 takes 16 MiB and tens of milliseconds, as RFC 7914 suggests for
# interactive logins. The parameters are stored in each hash, so they can be raised later.
SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
_SALT_BYTES = 16
_HASH_BYTES = 32
# Enough for the parameters above and for some headroom if they are raised.
_SCRYPT_MAXMEM = 256 * 1024 * 1024


# ---------------------------------------------------------------- hashing


def hash_password(password: str) -> str:
    """An encoded scrypt hash: "scrypt$n$r$p$salt$hash" (salt and hash in base64)."""
    salt = os.urandom(_SALT_BYTES)
    digest = _scrypt(password.encode("utf-8"), salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    return "$".join(
        ("scrypt", str(SCRYPT_N), str(SCRYPT_R), str(SCRYPT_P), _b64(salt), _b64(digest))
    )


def verify_password(password: str, encoded: str) -> bool:
    """True when `password` matches the encoded hash; a malformed hash matches nothing.

    Slow on purpose (scrypt); hashlib releases the GIL meanwhile, so callers on an event loop
    run it in a thread.
    """
    parts = encoded.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        return False
    try:
        n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
        salt = base64.b64decode(parts[4], validate=True)
        expected = base64.b64decode(parts[5], validate=True)
    except ValueError:
        return False
    digest = _scrypt(password.encode("utf-8", "surrogateescape"), salt, n, r, p, len(expected))
    return hmac.compare_digest(digest, expected)


# Verified against when a username does not exist, so that the reply takes as long as for a
# wrong password and does not tell which usernames exist.
DUMMY_HASH = "$".join(
    (
        "scrypt",
        str(SCRYPT_N),
        str(SCRYPT_R),
        str(SCRYPT_P),
        "AAAAAAAAAAAAAAAAAAAAAA==",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    )
)


MIN_PASSWORD = 12  # characters, for a password chosen by the operator


def generate_password() -> str:
    """A strong random password (144 bits), URL-safe so it survives any config file."""
    return secrets.token_urlsafe(18)


def _scrypt(
    password: bytes, salt: bytes, n: int, r: int, p: int, dklen: int = _HASH_BYTES
) -> bytes:
    return hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, dklen=dklen, maxmem=_SCRYPT_MAXMEM)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------- usernames

# A username is ASCII letters, digits and these, so that no two names can look alike on screen
# while being different users (Cyrillic U+0430 for "a", a fullwidth letter, an invisible joiner)
# and none carries a space or a control character. Two names are the same user when their normal
# forms (`username_key`: NFKC, then case folding) are equal: `user add` refuses a name whose normal
# form another user has, and AUTH finds a user by the normal form of the name the client sent.
MAX_USERNAME = 255
USERNAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "._-@+")


def username_problem(username: str) -> str | None:
    """Why `username` cannot be a new user's name (one sentence), or None when it can."""
    if not username or len(username) > MAX_USERNAME:
        return f"a username must have 1 to {MAX_USERNAME} characters"
    if not set(username) <= USERNAME_CHARACTERS:
        return (
            f"the username {username!r} may contain only ASCII letters, digits and . _ - @ + "
            "(no spaces, control characters or look-alike letters from other scripts)"
        )
    return None


def username_key(username: str) -> str:
    """The normal form two usernames are compared by: NFKC, then case folding."""
    return unicodedata.normalize("NFKC", username).casefold()


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Credential:
    id: uuid.UUID
    org_id: uuid.UUID
    org: str
    username: str
    disabled: bool
    created_at: datetime
    disabled_at: datetime | None
    lane: str | None = None  # the lane of the mail it sends, unless a message names one


@dataclass(frozen=True)
class Login:
    """What AUTH needs to check a password: the row's id, org, hash and state; and the user's
    lane, for the mail sent in that session (intake/lanes.py)."""

    id: uuid.UUID
    org_id: uuid.UUID
    username: str
    password_hash: str
    disabled: bool
    lane: str | None = None


class CredentialExists(Exception):
    pass


_COLUMNS = """c.id, c.org_id, o.name AS org, c.username, c.disabled, c.created_at, c.disabled_at,
    c.lane"""


def _credential(row: asyncpg.Record) -> Credential:
    return Credential(
        id=row["id"],
        org_id=row["org_id"],
        org=row["org"],
        username=row["username"],
        disabled=row["disabled"],
        created_at=row["created_at"],
        disabled_at=row["disabled_at"],
        lane=row["lane"],
    )


# One `user add` at a time (a transaction-scoped advisory lock), so that the check for a name of
# the same normal form sees every name committed before it.
_NAMES_LOCK = 0x70696765  # "pige"

# Names stored before the character rule may be outside ASCII; lower() then depends on the
# database's locale, and such a name is still found by its exact spelling.
_ADD = f"""
WITH c AS (
    INSERT INTO credential (id, org_id, username, password_hash, lane)
    SELECT $1, $2, $3, $4, $6
    WHERE NOT EXISTS (SELECT 1 FROM credential WHERE lower(username) = $5)
    ON CONFLICT (username) DO NOTHING
    RETURNING *)
SELECT {_COLUMNS} FROM c JOIN org o ON o.id = c.org_id
"""


async def add_credential(
    db: Executor, org_id: uuid.UUID, username: str, password_hash: str, *, lane: str | None = None
) -> Credential:
    """Add a user; CredentialExists when a user of the same normal form (`username_key`) exists."""
    async with transaction(db) as conn:
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _NAMES_LOCK)
        row = await conn.fetchrow(
            _ADD, new_id(), org_id, username, password_hash, username_key(username), lane
        )
        if row is None:
            existing = await conn.fetchval(
                "SELECT username FROM credential WHERE lower(username) = $1 OR username = $2",
                username_key(username),
                username,
            )
            if existing == username:
                raise CredentialExists(f"user '{username}' already exists")
            raise CredentialExists(
                f"user '{existing}' already exists and '{username}' differs from it only by case"
            )
    return _credential(row)


async def list_credentials(db: Executor) -> list[Credential]:
    rows = await db.fetch(
        f"SELECT {_COLUMNS} FROM credential c JOIN org o ON o.id = c.org_id "
        "ORDER BY o.name, c.username"
    )
    return [_credential(r) for r in rows]


async def disable_credential(db: Executor, username: str) -> Credential | None:
    """Disable a user (idempotent); None when there is no such user."""
    return await _update(
        db, username, "disabled = true, disabled_at = COALESCE(disabled_at, now())"
    )


async def enable_credential(db: Executor, username: str) -> Credential | None:
    """Let a disabled user log in again (idempotent); None when there is no such user."""
    return await _update(db, username, "disabled = false, disabled_at = NULL")


async def set_password(db: Executor, username: str, password_hash: str) -> Credential | None:
    """Replace a user's password; None when there is no such user. AUTH checks the new hash at
    once (its cache of verified logins is keyed by the hash)."""
    return await _update(db, username, "password_hash = $2", password_hash)


async def set_lane(db: Executor, username: str, lane: str | None) -> Credential | None:
    """Set the lane of the mail a user sends (None: the listener's); None when there is no such
    user. It holds from the user's next AUTH."""
    return await _update(db, username, "lane = $2", lane)


async def users_outside_lanes(db: Executor, lanes: Iterable[str]) -> dict[str, list[str]]:
    """The users whose lane is none of `lanes` (the settings changed after `user set`), by lane."""
    rows = await db.fetch(
        """SELECT lane, array_agg(username ORDER BY username) AS users FROM credential
           WHERE lane IS NOT NULL AND lane <> ALL ($1::text[])
           GROUP BY lane ORDER BY lane""",
        sorted(lanes),
    )
    return {r["lane"]: list(r["users"]) for r in rows}


async def _update(
    db: Executor, username: str, assignments: str, *args: object
) -> Credential | None:
    row = await db.fetchrow(
        f"""WITH c AS (
                UPDATE credential SET {assignments} WHERE username = $1 RETURNING *)
            SELECT {_COLUMNS} FROM c JOIN org o ON o.id = c.org_id""",
        username,
        *args,
    )
    return _credential(row) if row else None


async def delete_credential(db: Executor, username: str) -> Credential | None:
    """Delete a user; None when there is no such user. Its messages keep their `auth_user` (the
    name, for the log) and lose only the link to the row (used by the per-user message rate)."""
    async with transaction(db) as conn:
        row = await conn.fetchrow(
            f"SELECT {_COLUMNS} FROM credential c JOIN org o ON o.id = c.org_id "
            "WHERE c.username = $1 FOR UPDATE OF c",
            username,
        )
        if row is None:
            return None
        await conn.execute(
            "UPDATE message SET credential_id = NULL WHERE credential_id = $1", row["id"]
        )
        await conn.execute("DELETE FROM credential WHERE id = $1", row["id"])
    return _credential(row)


# The exact spelling first (a name stored before the character rule may differ from another only
# by case), then the normal form. Not an index lookup: lower(username) has no index, and the
# credential table is small next to the scrypt work every AUTH does.
_FIND_LOGIN = """
SELECT id, org_id, username, password_hash, disabled, lane FROM credential
WHERE username = $1 OR lower(username) = $2
ORDER BY username = $1 DESC, created_at
LIMIT 1
"""


async def find_login(db: Executor, username: str) -> Login | None:
    """The user AUTH named: the same name by its normal form (`username_key`)."""
    row = await db.fetchrow(_FIND_LOGIN, username, username_key(username))
    if row is None:
        return None
    return Login(
        id=row["id"],
        org_id=row["org_id"],
        username=row["username"],
        password_hash=row["password_hash"],
        disabled=row["disabled"],
        lane=row["lane"],
    )
