"""Memory and claim latency with a large queue: 1,000,000 recipients queued and not due.

    bench --SQL--> PostgreSQL (fresh database: 1M queued, not-due recipients) <-- pigeon-mta serve

Starts the real `pigeon-mta serve` (2 processes) on the loaded database, lets it run --seconds,
and reports each process's peak RSS and the claim statement's latency (timed from here, with the
same query the engine runs) at the start and at the end. Bounded; loopback only.

    .venv/bin/python bench/memory_bench.py [--rows 1000000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.e2e import children, peak_rss_mb, with_db, write_config  # noqa: E402
from pigeon_mta.store import claims  # noqa: E402
from pigeon_mta.store.migrate import migrate  # noqa: E402
from pigeon_mta.store.orgs import ensure_org  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def claim_latency_ms(conn: asyncpg.Connection, rounds: int = 50) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        await claims.claim_due_recipients(conn, owner="memory-bench", lease=300.0, batch=100)
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args()
    name = f"pigeon_mem_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_db(args.url, name)
    work = Path(tempfile.mkdtemp(prefix="pigeon-mem-"))
    conn = await asyncpg.connect(db_url)
    serve = None
    try:
        await migrate(conn)
        org = await ensure_org(conn, "internal")
        loaded = time.monotonic()
        await conn.execute(
            """WITH m AS (
                 INSERT INTO message (id, org_id, sender, size, body, listener)
                 SELECT gen_random_uuid(), $1, 's@bench.test', 20, 'Subject: m\r\n\r\nm\r\n', 'bench'
                 FROM generate_series(1, $2) RETURNING id, received_at)
               INSERT INTO recipient (id, message_id, org_id, address, domain, created_at, next_attempt_at)
               SELECT gen_random_uuid(), m.id, $1, 'r' || left(m.id::text, 8) || '@d.test', 'd.test',
                      m.received_at, now() + interval '1 day'
               FROM m""",
            org,
            args.rows,
        )
        await conn.execute("VACUUM ANALYZE")
        print(f"loaded {args.rows:,} not-due recipients in {time.monotonic() - loaded:.0f}s")
        before = await claim_latency_ms(conn)
        config = work / "pigeon.toml"
        write_config(
            config,
            f"""[server]
data_dir = "{work}"
node_name = "memory-bench"
processes = 2
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{free_port()}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[log]
delivery_log = ""
""",
        )
        log = open(work / "serve.log", "w")
        serve = subprocess.Popen(
            [sys.executable, "-m", "pigeon_mta", "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        await asyncio.sleep(args.seconds)
        after = await claim_latency_ms(conn)
        pids = [serve.pid, *children(serve.pid)]
        rss = {pid: peak_rss_mb(pid) for pid in pids}
        print(
            f"# memory_bench {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} cores"
        )
        print(f"| queued, not due | {args.rows:,} recipients |")
        for pid, mb in rss.items():
            print(f"| peak RSS pid {pid} | {mb:.1f} MB (target < 200 MB) |")
        print(
            f"| claim statement, median of 50 (nothing due) | {before:.2f} ms before serve, {after:.2f} ms after {args.seconds:.0f}s of serve |"
        )
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                serve.kill()
        await conn.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
