"""A process's short memory of the API's yes-answers: which key is valid, which sender domain is
the org's (`api.auth_cache`).

Asked of PostgreSQL at every request, the key and the sender domain would be two transactions of
a send's three and a half, and most of the database's CPU for API mail (bench/README.md, "HTTP API
and webhooks"). Remembered for a second, they cost one look-up per key and domain per second and
process. Only "yes" is remembered: a key made or a domain added a moment ago works at once, and a
wrong key is asked about every time. What a "yes" costs is the lag of a "no": a key revoked or a
domain removed is still honoured, by a process that asked within the last `ttl` seconds, until
that answer runs out. (An SMTP session keeps its AUTH for as long as its connection lasts.)

Concurrent requests for the same entry share one look-up; a look-up that fails (the database is
away) is not remembered, and each of its waiters gets its error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Entries kept at most; past it the memory starts afresh (a flood of distinct keys costs look-ups,
# not memory).
MAX_ENTRIES = 10_000


class Memo(Generic[K, V]):
    def __init__(
        self,
        ttl: float,
        *,
        keep: Callable[[V], bool] = bool,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`ttl`: seconds an answer is kept (0: never kept). `keep(answer)`: whether to keep it
        (by default, a true answer)."""
        self.ttl = ttl
        self._keep = keep
        self._max = max_entries
        self._clock = clock
        self._entries: dict[K, tuple[float, asyncio.Future[V]]] = {}

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        if self.ttl <= 0:
            return await load()
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and entry[0] > now:
            return await asyncio.shield(entry[1])
        if len(self._entries) >= self._max:
            self._entries.clear()
        future: asyncio.Future[V] = asyncio.ensure_future(self._load(key, load))
        # Its error reaches the waiters; if they have all gone, it is not worth a warning.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._entries[key] = (now + self.ttl, future)
        return await asyncio.shield(future)

    async def _load(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        try:
            value = await load()
        except BaseException:
            self._forget(key)
            raise
        if not self._keep(value):
            self._forget(key)
        return value

    def _forget(self, key: K) -> None:
        """Drop the entry of the load running now (not a newer one made after a clear)."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] is asyncio.current_task():
            del self._entries[key]
