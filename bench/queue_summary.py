"""How long `pigeon-mta queue` (the summary) takes with 1,000,000 rows in the recipient table.

    python bench/queue_summary.py [--rows 1000000] [--queued 0.05] [--runs 30] [--url URL]

Builds a scratch database on the server at --url (default: $PIGEON_BENCH_DATABASE_URL, else the
local PostgreSQL on 127.0.0.1:5432), fills it with a mix that looks like a relay's history (mostly
delivered, some bounced/expired/cancelled/suppressed, and a live queue of --queued of the rows,
four fifths of it deferred across 200 destinations), vacuums it as autovacuum would, then times:

- the summary query itself (`store.queue_summary.queue_summary`), --runs times;
- the whole command (`python -m pigeon_mta queue`), a few times, process start included.

The database is dropped at the end (--keep leaves it). Target: within 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pigeon_mta.store import queue_summary  # noqa: E402
from pigeon_mta.store.migrate import migrate  # noqa: E402

DB_NAME = "pigeon_bench_queue_summary"


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


# Messages of 10 recipients each. r decides a recipient's fate: the last `queued` share is the live
# queue (a fifth never tried yet and due, the rest deferred with a reply, due within the hour).
_FILL = """
WITH m AS (
    INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
    SELECT gen_random_uuid(), $1, 'app@example.com', 40,
           'Subject: bench\r\nMessage-ID: <x@example.com>\r\n\r\nbody\r\n', 'relay',
           now() - make_interval(secs => random() * 86400 * 3)
    FROM generate_series(1, $2)
    RETURNING id, received_at
), r AS (
    SELECT m.id AS message_id, m.received_at, n, random() AS r
    FROM m, generate_series(1, 10) AS n
)
INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts, created_at,
                       next_attempt_at, last_code, last_enhanced_code, last_response, updated_at)
SELECT gen_random_uuid(), message_id, $1, 'user' || n || '@d' || (hashtext(message_id::text || n) & 255) || '.example',
       'd' || (abs(hashtext(message_id::text || n)) % 200) || '.example',
       CASE WHEN r < 1 - $3::float8 - 0.08 THEN 'delivered'
            WHEN r < 1 - $3::float8 - 0.05 THEN 'bounced'
            WHEN r < 1 - $3::float8 - 0.03 THEN 'expired'
            WHEN r < 1 - $3::float8 - 0.02 THEN 'cancelled'
            WHEN r < 1 - $3::float8 THEN 'suppressed'
            ELSE 'queued' END,
       CASE WHEN r < 1 - $3::float8 * 0.8 THEN 1 ELSE 1 + (r * 100)::int % 7 END
           - CASE WHEN r >= 1 - $3::float8 AND r < 1 - $3::float8 * 0.8 THEN 1 ELSE 0 END,
       received_at,
       CASE WHEN r >= 1 - $3::float8 * 0.8 THEN now() + make_interval(secs => (r * 1e6)::int % 3600)
            ELSE received_at END,
       CASE WHEN r >= 1 - $3::float8 * 0.8 THEN 451 END,
       CASE WHEN r >= 1 - $3::float8 * 0.8 THEN '4.7.1' END,
       CASE WHEN r >= 1 - $3::float8 * 0.8 THEN 'try again later' END,
       now() - make_interval(secs => (r * 1e7)::int % 3600)
FROM r
"""


async def build(url: str, rows: int, queued: float) -> str:
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{DB_NAME}"')
    finally:
        await admin.close()
    bench_url = with_database(url, DB_NAME)
    conn = await asyncpg.connect(bench_url)
    try:
        await migrate(conn)
        org = await conn.fetchval(
            "INSERT INTO org (id, name) VALUES (gen_random_uuid(), 'bench') RETURNING id"
        )
        started = time.perf_counter()
        batch = 20_000  # messages per statement (200,000 recipients)
        for done in range(0, rows // 10, batch):
            await conn.execute(_FILL, org, min(batch, rows // 10 - done), queued)
        await conn.execute("VACUUM ANALYZE recipient")
        await conn.execute("VACUUM ANALYZE message")
        print(f"filled {rows:,} recipients in {time.perf_counter() - started:.1f}s")
        mix = await conn.fetch(
            """SELECT status, attempts > 0 AS tried, count(*) FROM recipient
               GROUP BY 1, 2 ORDER BY 3 DESC"""
        )
        print(
            "mix: "
            + ", ".join(f"{r['status']}{'' if r['tried'] else '(new)'}={r['count']:,}" for r in mix)
        )
    finally:
        await conn.close()
    return bench_url


async def time_query(url: str, runs: int) -> list[float]:
    conn = await asyncpg.connect(url)
    try:
        await queue_summary.queue_summary(conn)  # warm the cache and the prepared statements
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            await queue_summary.queue_summary(conn)
            times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        await conn.close()


def time_command(url: str, runs: int) -> list[float]:
    env = {**os.environ, "PIGEON_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "pigeon_mta", "queue"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        times.append((time.perf_counter() - started) * 1000)
        if result.returncode != 0:
            raise SystemExit(result.stderr)
    print(result.stdout)
    return times


def describe(name: str, times: list[float]) -> None:
    times = sorted(times)
    p95 = times[min(len(times) - 1, int(len(times) * 0.95))]
    print(
        f"{name}: median {statistics.median(times):.1f} ms, p95 {p95:.1f} ms, "
        f"min {times[0]:.1f} ms ({len(times)} runs)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queued", type=float, default=0.05, help="share of rows in the queue")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = parser.parse_args()
    bench_url = await build(args.url, args.rows, args.queued)
    try:
        describe("summary query", await time_query(bench_url, args.runs))
        describe("whole command (process start included)", time_command(bench_url, 5))
    finally:
        if not args.keep:
            admin = await asyncpg.connect(args.url)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
            finally:
                await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
