"""SMTP AUTH credentials: the credential table, and the scrypt hashes its passwords are kept as."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.ids import new_id
from pigeon_mta.store.queue import Executor

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


def generate_password() -> str:
    """A strong random password (144 bits), URL-safe so it survives any config file."""
    return secrets.token_urlsafe(18)


def _scrypt(
    password: bytes, salt: bytes, n: int, r: int, p: int, dklen: int = _HASH_BYTES
) -> bytes:
    return hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, dklen=dklen, maxmem=_SCRYPT_MAXMEM)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


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


@dataclass(frozen=True)
class Login:
    """What AUTH needs to check a password: the row's id, org, hash and state."""

    id: uuid.UUID
    org_id: uuid.UUID
    username: str
    password_hash: str
    disabled: bool


class CredentialExists(Exception):
    pass


_COLUMNS = """c.id, c.org_id, o.name AS org, c.username, c.disabled, c.created_at, c.disabled_at"""


def _credential(row: asyncpg.Record) -> Credential:
    return Credential(
        id=row["id"],
        org_id=row["org_id"],
        org=row["org"],
        username=row["username"],
        disabled=row["disabled"],
        created_at=row["created_at"],
        disabled_at=row["disabled_at"],
    )


async def add_credential(
    db: Executor, org_id: uuid.UUID, username: str, password_hash: str
) -> Credential:
    row = await db.fetchrow(
        f"""WITH c AS (
                INSERT INTO credential (id, org_id, username, password_hash)
                VALUES ($1, $2, $3, $4) ON CONFLICT (username) DO NOTHING
                RETURNING *)
            SELECT {_COLUMNS} FROM c JOIN org o ON o.id = c.org_id""",
        new_id(),
        org_id,
        username,
        password_hash,
    )
    if row is None:
        raise CredentialExists(f"user '{username}' already exists")
    return _credential(row)


async def list_credentials(db: Executor) -> list[Credential]:
    rows = await db.fetch(
        f"SELECT {_COLUMNS} FROM credential c JOIN org o ON o.id = c.org_id "
        "ORDER BY o.name, c.username"
    )
    return [_credential(r) for r in rows]


async def disable_credential(db: Executor, username: str) -> Credential | None:
    """Disable a user (idempotent); None when there is no such user."""
    row = await db.fetchrow(
        f"""WITH c AS (
                UPDATE credential
                SET disabled = true, disabled_at = COALESCE(disabled_at, now())
                WHERE username = $1
                RETURNING *)
            SELECT {_COLUMNS} FROM c JOIN org o ON o.id = c.org_id""",
        username,
    )
    return _credential(row) if row else None


async def find_login(db: Executor, username: str) -> Login | None:
    row = await db.fetchrow(
        "SELECT id, org_id, username, password_hash, disabled FROM credential WHERE username = $1",
        username,
    )
    if row is None:
        return None
    return Login(
        id=row["id"],
        org_id=row["org_id"],
        username=row["username"],
        password_hash=row["password_hash"],
        disabled=row["disabled"],
    )
