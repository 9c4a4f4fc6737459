"""SMTP AUTH decisions: checking a login against the credential table, and failure throttling.

scrypt is slow on purpose (tens of milliseconds of CPU), and applications that open a connection
per message AUTH every time. A successful check is therefore remembered for a few minutes, keyed
by an HMAC of the password under a per-process secret together with the stored hash: the row is
still read on every AUTH, so disabling a user or changing a password takes effect at once.

Every check that is not such a remembered success runs scrypt, whether the user is unknown,
disabled or gave a wrong password: the time of the reply does not tell which users exist or are
disabled.

Throttling counts failures per client IP in the database. Each failure is counted by one
statement that returns the new count (store.limits.record_auth_failure), and the failure past
the limit is answered 454 there, however many checks of one IP run at once. A client already
over the limit is refused before its password is read (`is_throttled`), and a right password
whose check ends after parallel failures reached the limit is refused too: a burst of guesses
learns the outcome of at most the limit's worth of them.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import asyncpg

from pigeon_mta.config import LimitsSettings
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.store import limits as store_limits

CACHE_SECONDS = 300.0
CACHE_ENTRIES = 10_000


class Verdict(enum.Enum):
    OK = "ok"
    INVALID = "invalid"  # unknown user, wrong password, or disabled: the client is told the same
    THROTTLED = "throttled"  # the right password, but the client IP is over its failure limit


@dataclass(frozen=True)
class Checked:
    verdict: Verdict
    login: store_credentials.Login | None = None
    reason: str = ""  # for the log only


class Authenticator:
    """Shared by every listener of a process."""

    def __init__(self, pool: asyncpg.Pool, limits: LimitsSettings) -> None:
        self.pool = pool
        self.limits = limits
        self._secret = os.urandom(32)
        self._verified: OrderedDict[bytes, float] = OrderedDict()

    async def is_throttled(self, client_ip: str) -> bool:
        """Whether `client_ip` failed AUTH too often lately (raises on database trouble)."""
        if self.limits.max_auth_failures <= 0:
            return False
        failures = await store_limits.recent_auth_failures(
            self.pool, client_ip=client_ip, window=self.limits.auth_failure_window
        )
        return failures >= self.limits.max_auth_failures

    async def record_failure(self, *, client_ip: str, username: str | None, listener: str) -> bool:
        """Count a failure of `client_ip`; whether it is past the limit (raises on database
        trouble). The count and the decision are one statement, so parallel failures each get
        their own place in the count."""
        if self.limits.max_auth_failures <= 0:
            return False
        failures = await store_limits.record_auth_failure(
            self.pool,
            client_ip=client_ip,
            username=username,
            listener=listener,
            window=self.limits.auth_failure_window,
        )
        return failures > self.limits.max_auth_failures

    async def check(self, username: str, password: str, *, client_ip: str) -> Checked:
        """Check a login (raises on database trouble)."""
        login = await store_credentials.find_login(self.pool, username)
        key = self._cache_key(login, password) if login is not None else b""
        if login is not None and not login.disabled and self._recently_verified(key):
            return Checked(Verdict.OK, login)
        # The same scrypt work in every case below (see the module docstring).
        matches = await asyncio.to_thread(
            store_credentials.verify_password,
            password,
            login.password_hash if login is not None else store_credentials.DUMMY_HASH,
        )
        if login is None:
            return Checked(Verdict.INVALID, reason="no such user")
        if login.disabled:
            return Checked(Verdict.INVALID, login, reason="user is disabled")
        if not matches:
            return Checked(Verdict.INVALID, login, reason="wrong password")
        self._remember(key)
        if await self.is_throttled(client_ip):
            return Checked(Verdict.THROTTLED, login, reason="too many recent failures")
        return Checked(Verdict.OK, login)

    def _cache_key(self, login: store_credentials.Login, password: str) -> bytes:
        material = "\0".join((str(login.id), login.password_hash, password))
        return hmac.new(
            self._secret, material.encode("utf-8", "surrogatepass"), hashlib.sha256
        ).digest()

    def _recently_verified(self, key: bytes) -> bool:
        until = self._verified.get(key)
        if until is None:
            return False
        if until < time.monotonic():
            del self._verified[key]
            return False
        return True

    def _remember(self, key: bytes) -> None:
        self._verified[key] = time.monotonic() + CACHE_SECONDS
        self._verified.move_to_end(key)
        while len(self._verified) > CACHE_ENTRIES:
            self._verified.popitem(last=False)
