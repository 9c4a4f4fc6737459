"""Who is asking: the API key of a request (`Authorization: Bearer KEY`, RFC 6750), found in the
database or in the process's memory of keys found within `api.auth_cache` (memo.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import asyncpg
from aiohttp import web

from pigeon_mta.api import problems
from pigeon_mta.api.memo import Memo
from pigeon_mta.api.problems import Problem
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store.apikeys import ApiKey
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger("pigeon_mta.api")

# Longer than any key `apikey add` makes; a longer header is not worth a lookup.
_MAX_KEY = 200


class Authenticator:
    def __init__(
        self, pool: asyncpg.Pool, *, cache: float = 0.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`cache`: seconds a found key is remembered (a revoked key is refused at the latest
        that long after its revocation)."""
        self.pool = pool
        # By the key's hash, as the table keeps it: the process holds no key past its request.
        self._found: Memo[bytes, ApiKey | None] = Memo(cache, clock=clock)

    async def find(self, key: str) -> ApiKey | None:
        """The unrevoked key `key` is, or None (raises on database trouble)."""
        return await self._found.get(
            store_apikeys.key_hash(key), lambda: store_apikeys.find_active_key(self.pool, key)
        )

    async def __call__(self, request: web.Request) -> ApiKey:
        """The unrevoked key the request carries; a Problem (401, or 503 on database trouble)."""
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
        if len(key) <= _MAX_KEY and key.isascii():
            try:
                found = await self.find(key)
            except DB_ERRORS as exc:
                log.warning("API request from [%s]: database trouble: %s", request.remote, exc)
                raise problems.database_unavailable("the API key could not be checked") from None
        if found is None:
            log.info("API request from [%s] refused: unknown or revoked key", request.remote)
            raise Problem(
                problems.UNAUTHORIZED,
                "The API key in the Authorization header is not valid or has been revoked.",
            )
        return found
