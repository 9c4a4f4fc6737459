"""What store functions run their statements on: a pool or a connection, and a transaction on it."""

from __future__ import annotations

import contextlib
import typing
from collections.abc import AsyncIterator

import asyncpg

Executor = asyncpg.Pool | asyncpg.Connection


@contextlib.asynccontextmanager
async def transaction(db: Executor) -> AsyncIterator[asyncpg.Connection]:
    """A transaction on a pooled connection, or on (or nested in) the connection given."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn, conn.transaction():
            # The pool hands out a proxy that behaves as the connection it wraps.
            yield typing.cast(asyncpg.Connection, conn)
    else:
        async with db.transaction():
            yield db
