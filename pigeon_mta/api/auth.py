"""Who is asking: the API key of a request (`Authorization: Bearer KEY`, RFC 6750), found in the
database or in the process's memory of keys found within `api.auth_cache` (pigeon_mta/memo.py).

A request is asked for its key before its body is read (api/server.py), so that a client without
one costs a header's worth of work, not a body's. Wrong keys are throttled per client address as
SMTP AUTH failures are (submission/auth.py, the same `limits.max_auth_failures` per
`limits.auth_failure_window`, counted in the same table across every listener, process and node):
past the limit, the address is answered 429 with Retry-After until its window ends, without a
lookup, and the process remembers that in memory, so a flood of guesses costs no statement each.
A key this process found valid within the window still gets through a throttled address: behind
a proxy every client shares its address, and one client's wrong key must not lock the others
out. Only the first failure of an address in its window and its being throttled are logged.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import asyncpg
from aiohttp import web

from pigeon_mta.api import problems
from pigeon_mta.api.problems import Problem
from pigeon_mta.config import API_LISTENER, LimitsSettings
from pigeon_mta.memo import Memo
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import limits as store_limits
from pigeon_mta.store.apikeys import ApiKey
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger("pigeon_mta.api")

# Longer than any key `apikey add` makes; a longer header is not worth a lookup.
_MAX_KEY = 200
# Where the key found for a request is kept, once asked for (before its body is read).
REQUEST_KEY = web.RequestKey("pigeon.api_key", ApiKey)
# Throttled client addresses and trusted key hashes a process remembers, at most each (the oldest
# are forgotten first).
_MAX_REMEMBERED = 10_000
_T = TypeVar("_T")


class Authenticator:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        cache: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        limits: LimitsSettings | None = None,
    ) -> None:
        """`cache`: seconds a found key is remembered (a revoked key is refused at the latest
        that long after its revocation). `limits`: the failure throttle's (module docstring)."""
        self.pool = pool
        self.limits = limits or LimitsSettings()
        self.clock = clock
        # By the key's hash, as the table keeps it: the process holds no key past its request.
        self._found: Memo[bytes, ApiKey | None] = Memo(cache, clock=clock)
        # Client addresses past their failure limit, until when (on `clock`).
        self._throttled: OrderedDict[str, float] = OrderedDict()
        # Hashes of keys found valid, until when they pass a throttled address (on `clock`).
        self._trusted: OrderedDict[bytes, float] = OrderedDict()

    async def find(self, key: str) -> ApiKey | None:
        """The unrevoked key `key` is, or None (raises on database trouble)."""
        return await self._found.get(
            store_apikeys.key_hash(key), lambda: store_apikeys.find_active_key(self.pool, key)
        )

    async def __call__(self, request: web.Request) -> ApiKey:
        """The unrevoked key the request carries; a Problem (401; 429 for an address past its
        failure limit; 503 on database trouble). Asked again for the same request, the key
        found the first time."""
        if REQUEST_KEY in request:
            return request[REQUEST_KEY]
        address = _client_address(request)
        header = request.headers.get("Authorization")
        if header is None:
            raise Problem(
                problems.UNAUTHORIZED,
                "The Authorization header is missing: send 'Authorization: Bearer KEY' with a key "
                "from 'pigeon-mta apikey add'.",
            )
        scheme, _, key = header.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Problem(problems.UNAUTHORIZED, "The Authorization header must be 'Bearer KEY'.")
        found = None
        usable = len(key) <= _MAX_KEY and key.isascii()
        hashed = store_apikeys.key_hash(key) if usable else b""
        self._refuse_if_throttled(address, hashed)
        if usable:
            try:
                found = await self.find(key)
            except DB_ERRORS as exc:
                log.warning("API request from [%s]: database trouble: %s", address, exc)
                raise problems.database_unavailable("the API key could not be checked") from None
        if found is None:
            await self._failed(address)
            raise Problem(
                problems.UNAUTHORIZED,
                "The API key in the Authorization header is not valid or has been revoked.",
            )
        self._remember(self._trusted, hashed, self.limits.auth_failure_window)
        request[REQUEST_KEY] = found
        return found

    def _refuse_if_throttled(self, address: str, key_hash: bytes) -> None:
        until = self._throttled.get(address)
        if until is None:
            return
        now = self.clock()
        left = until - now
        if left <= 0:
            del self._throttled[address]
            return
        if self._trusted.get(key_hash, 0.0) > now:
            return  # a key found valid lately: another client behind the same address
        raise _throttled(left)

    def _remember(self, memory: OrderedDict[_T, float], item: _T, seconds: float) -> None:
        memory[item] = self.clock() + seconds
        memory.move_to_end(item)
        while len(memory) > _MAX_REMEMBERED:
            memory.popitem(last=False)

    async def _failed(self, address: str) -> None:
        """Count a wrong key of `address`; raises the 429 when that puts it past the limit."""
        limit = self.limits.max_auth_failures
        if limit <= 0:
            log.info("API request from [%s] refused: unknown or revoked key", address)
            return
        window = self.limits.auth_failure_window
        try:
            count = await store_limits.record_auth_failure(
                self.pool, client_ip=address, username=None, listener=API_LISTENER, window=window
            )
        except DB_ERRORS as exc:
            log.warning("cannot record the API key failure of [%s]: %s", address, exc)
            return
        if count == 1:
            log.info(
                "API request from [%s] refused: unknown or revoked key (its further failures "
                "within %g s are not logged)",
                address,
                window,
            )
        if count > limit:
            if count == limit + 1:
                log.warning(
                    "API requests from [%s] throttled for %g s: %d wrong API keys",
                    address,
                    window,
                    limit,
                )
            self._remember(self._throttled, address, window)
            raise _throttled(window)


def _throttled(seconds: float) -> Problem:
    return Problem(
        problems.TOO_MANY_KEY_FAILURES,
        "Too many requests from this address carried a wrong API key; try again later.",
        retry_after=max(1, int(seconds + 0.999)),
    )


def _client_address(request: web.Request) -> str:
    """The peer's IP address (what the throttle counts, as an inet); "0.0.0.0" when the
    transport has none (a Unix socket)."""
    try:
        return str(ipaddress.ip_address(request.remote or ""))
    except ValueError:
        return "0.0.0.0"
