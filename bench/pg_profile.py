"""Where PostgreSQL's work goes during a bench run: its server's processes (for their CPU), and,
when the server loads pg_stat_statements, time, calls, WAL and buffers per statement.

Only the processes of the server the bench talks to count: other databases' clients on the same
machine (another bench, a test suite) are not this run's cost.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import asyncpg


def _parent(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def server_processes(conn: asyncpg.Connection) -> Callable[[], list[int]]:
    """A function that lists the processes of the PostgreSQL server `conn` is connected to (its
    postmaster and every child: backends, WAL writer, checkpointer...), found through the parent
    of this connection's backend. The server must run on this machine."""
    backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
    postmaster = _parent(backend)
    if postmaster is None:
        raise SystemExit("PostgreSQL's processes are not on this machine: its CPU is not measured")
    return lambda: [postmaster, *_children(postmaster)]


async def statements_available(conn: asyncpg.Connection) -> bool:
    """Whether the server loads pg_stat_statements; if so, its view is made in this database."""
    loaded = await conn.fetchval("SHOW shared_preload_libraries")
    if "pg_stat_statements" not in str(loaded):
        return False
    await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return True


async def reset(conn: asyncpg.Connection) -> None:
    """Zero the server's statement, WAL and table counters (the start of a measured phase)."""
    await conn.execute("SELECT pg_stat_statements_reset()")
    await conn.execute("SELECT pg_stat_reset_shared('wal')")
    await conn.execute("SELECT pg_stat_reset()")


_ACTIVITY = """
SELECT pid, backend_type, datname, left(query, 30) AS query FROM pg_stat_activity
"""
_ENQUEUE_PREFIXES = ("WITH u AS", "WITH d AS", "WITH m AS")


async def cpu_by_role(
    conn: asyncpg.Connection, used: dict[int, float], messages: int
) -> dict[str, float]:
    """Milliseconds of CPU per message by kind of server process, from each process's CPU
    (`used`, by pid): background processes by their type; client backends as the submission
    path's commits (their last statement an enqueue), the bench's own, or the engine and
    everything else the service runs (claims, records, maintenance)."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    bench = int(await conn.fetchval("SELECT pg_backend_pid()"))
    database = await conn.fetchval("SELECT current_database()")
    kinds: dict[int, str] = {}
    for r in await conn.fetch(_ACTIVITY):
        if r["backend_type"] != "client backend":
            kinds[r["pid"]] = r["backend_type"]
        elif r["pid"] == bench or r["datname"] != database:
            kinds[r["pid"]] = "the bench's connections"
        elif str(r["query"]).lstrip().startswith(_ENQUEUE_PREFIXES):
            kinds[r["pid"]] = "submission commits"
        else:
            kinds[r["pid"]] = "engine and the rest of the service"
    out: dict[str, float] = {}
    for pid, seconds in used.items():
        kind = kinds.get(pid, "postmaster")
        out[kind] = out.get(kind, 0.0) + seconds
    return {k: round(v * 1000 / max(1, messages), 4) for k, v in sorted(out.items())}


_STATEMENTS = """
SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), $2) AS query, calls, rows,
       round(total_exec_time::numeric, 1) AS exec_ms,
       round(total_plan_time::numeric, 1) AS plan_ms,
       wal_bytes::bigint AS wal_bytes, wal_records, wal_fpi,
       shared_blks_hit, shared_blks_read, shared_blks_dirtied, shared_blks_written
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time + total_plan_time DESC
LIMIT $1
"""

_TABLES = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
FROM pg_stat_user_tables WHERE n_tup_ins + n_tup_upd + n_tup_del > 0 ORDER BY relname
"""


async def report(conn: asyncpg.Connection, messages: int, top: int = 15) -> dict[str, object]:
    """Per delivered message: each statement's calls, time, WAL bytes and buffers; the server's
    WAL; and rows written per table (HOT updates apart)."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    per = max(1, messages)
    statements = [
        {
            "query": r["query"],
            "calls_per_msg": round(r["calls"] / per, 3),
            "rows_per_call": round(r["rows"] / max(1, r["calls"]), 1),
            "exec_ms_per_msg": round(float(r["exec_ms"]) / per, 4),
            "plan_ms_per_msg": round(float(r["plan_ms"]) / per, 4),
            "wal_bytes_per_msg": round(r["wal_bytes"] / per),
            "wal_fpi_per_msg": round(r["wal_fpi"] / per, 2),
            "blks_hit_per_msg": round(r["shared_blks_hit"] / per, 1),
            "blks_dirtied_per_msg": round(r["shared_blks_dirtied"] / per, 2),
        }
        for r in await conn.fetch(_STATEMENTS, top, 160)
    ]
    wal = await conn.fetchrow("SELECT wal_records, wal_fpi, wal_bytes::bigint FROM pg_stat_wal")
    assert wal is not None
    tables = {
        r["relname"]: {k: round(r[k] / per, 2) for k in r.keys() if k != "relname"}
        for r in await conn.fetch(_TABLES)
    }
    return {
        "statements": statements,
        "wal_per_msg": {k: round(wal[k] / per, 1) for k in wal.keys()},
        "table_rows_per_msg": tables,
    }
