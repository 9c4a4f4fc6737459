"""Where the database is: the configured URL, or an embedded PostgreSQL kept in data_dir; pools."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.redaction import redact
from pigeon_mta.store.embedded import EmbeddedError, start_embedded
from pigeon_mta.store.errors import DB_ERRORS as DB_ERRORS  # where callers have found it
from pigeon_mta.store.group_commit import MAX_COMMITS

log = logging.getLogger(__name__)


class DatabaseUnavailable(Exception):
    """The database cannot be reached or started; the message says why, in one sentence."""


@dataclass(frozen=True)
class DatabaseLocation:
    url: str
    description: str  # for logs: "postgresql at 10.0.0.5" or "embedded PostgreSQL in /var/lib/..."
    embedded_dir: Path | None = None


def locate_database(settings: Settings) -> DatabaseLocation:
    """The configured database, or (when none is configured) the embedded one, started if needed."""
    if settings.database.url:
        return DatabaseLocation(
            settings.database.url, f"PostgreSQL at {redact(settings.database.url)}"
        )
    pgdata = Path(settings.server.data_dir).expanduser() / "postgres"
    return DatabaseLocation(_start_embedded(pgdata), f"embedded PostgreSQL in {pgdata}", pgdata)


def _start_embedded(pgdata: Path) -> str:
    try:
        return start_embedded(pgdata)
    except EmbeddedError as exc:
        raise DatabaseUnavailable(str(exc)) from None


def server_settings(
    settings: Settings, *, generic_plans: bool = False, by_key: bool = False
) -> dict[str, str]:
    """The session settings of the service's connections. `generic_plans`: for connections that
    only run statements whose plan cannot depend on the tables' size (the submission path's
    commits: inserts of the rows given), which PostgreSQL may then plan once per connection.
    `by_key`: for connections whose statements find their rows by key (the engine's record, see
    `record_pool`), planned once, as index lookups."""
    if by_key:
        return {
            **server_settings(settings),
            # A generic plan, made once per connection and statement...
            "plan_cache_mode": "force_generic_plan",
            # ... that finds rows through their indexes at any size of the tables: made while
            # a table is nearly empty, a plan free to choose would scan it whole, and keep doing
            # so as it grows to millions of rows. With these off, PostgreSQL takes a sequential
            # scan or a hash or merge join only where no index path exists.
            "enable_seqscan": "off",
            "enable_hashjoin": "off",
            "enable_mergejoin": "off",
        }
    return {
        "application_name": "pigeon-mta",
        "statement_timeout": str(int(settings.database.statement_timeout * 1000)),
        # Queue queries are short; JIT compilation only adds latency to them.
        "jit": "off",
        # Plan every execution for its own parameters and the table as it is now. The queue
        # tables go from empty to millions of rows and the batches from 1 to 1,000 ids; a generic
        # plan cached early (say, a sequential scan chosen while the table was nearly empty) is
        # kept until the next ANALYZE and can be wrong by orders of magnitude. Measured on a new
        # database, end to end with DKIM: generic plans cost PostgreSQL 11-12 s of CPU for 20,000
        # messages and gave 797-840 msgs/s; planned each time, 9.9 s and 890 msgs/s (planning
        # these statements costs far less than one bad scan). But planning an enqueue again for
        # each message cost a third of the one-connection enqueue rate (1,220-1,250 msgs/s against
        # 1,720-1,850, bench/README.md "Queue"), and its plan is the same at any size.
        "plan_cache_mode": "auto" if generic_plans else "force_custom_plan",
    }


async def connect(url: str, settings: Settings) -> asyncpg.Connection:
    return await asyncpg.connect(
        url,
        timeout=settings.database.connect_timeout,
        server_settings=server_settings(settings),
    )


async def create_pool(
    url: str,
    settings: Settings,
    *,
    size: int | None = None,
    generic_plans: bool = False,
    by_key: bool = False,
) -> asyncpg.Pool:
    size = size or settings.database.pool_size
    kwargs: dict[str, Any] = {
        "min_size": min(2, size),
        "max_size": size,
        "timeout": settings.database.connect_timeout,
        "command_timeout": settings.database.statement_timeout + 5,
        "server_settings": server_settings(settings, generic_plans=generic_plans, by_key=by_key),
        # Idle connections are recycled so that a restarted server is noticed quickly.
        "max_inactive_connection_lifetime": 60.0,
        "reset": _keep_session,
    }
    pool = await asyncpg.create_pool(url, **kwargs)
    assert pool is not None
    return pool


async def commit_pool(url: str, settings: Settings) -> asyncpg.Pool:
    """A worker's connections for the submission path's commits (store/group_commit.py): one per
    commit it runs at once, planned generically (`server_settings`), and never waiting behind the
    engine's statements for a connection of the main pool."""
    return await create_pool(url, settings, size=MAX_COMMITS, generic_plans=True)


async def record_pool(url: str, settings: Settings) -> asyncpg.Pool:
    """A worker's connections for its engine's records (outbound/recorder.py): one transaction
    under way at a time. The record statement, its bounces and suppression entries find their
    rows by key, so they are planned once per connection (`server_settings` with `by_key`):
    planned at every call, the record's planning cost PostgreSQL as much as its execution
    (bench/README.md "End to end")."""
    return await create_pool(url, settings, size=2, by_key=True)


@dataclass(frozen=True)
class WorkerPools:
    main: asyncpg.Pool
    commits: asyncpg.Pool  # commit_pool
    records: asyncpg.Pool | None  # record_pool, when the worker delivers


async def worker_pools(
    url: str, settings: Settings, stack: contextlib.AsyncExitStack
) -> WorkerPools:
    """A worker process's pools, each closed by `stack` (in reverse order, each whatever happens
    to the others)."""
    pools: list[asyncpg.Pool | None] = []
    for make in (create_pool, commit_pool, record_pool if settings.delivery.enabled else None):
        pool = await make(url, settings) if make is not None else None
        if pool is not None:
            stack.push_async_callback(pool.close)
        pools.append(pool)
    main, commits, records = pools
    assert main is not None and commits is not None
    return WorkerPools(main, commits, records)


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Pool connections are returned as they are: asyncpg still rolls back an open transaction,
    and pigeon never changes session state on them (no SET, LISTEN or advisory locks), so the
    default reset query would only cost a round trip per release (one per enqueued message)."""
