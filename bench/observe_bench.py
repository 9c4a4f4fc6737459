"""How fast `/metrics` answers, and what the queue stats query costs, with 1,000,000 recipient rows.

    HTTP client ──► pigeon-mta serve --processes N (listener = [], metrics on a free loopback port)
                                └── PostgreSQL: a scratch database with --rows recipient rows

The rows are bulk-loaded in SQL: --live of them queued (not due while serve runs, so no engine
touches them; relayhost points at a closed loopback port all the same) and the rest delivered
history. Then: --scrapes sequential scrapes of /metrics and /readyz, one new connection each, as
Prometheus does; then serve stops, half the live rows are made due, and the stats query that feeds
the queue gauges is timed. The scratch database is dropped at the end.

    python bench/observe_bench.py [--rows 1000000] [--live 50000] [--processes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.e2e import write_config  # noqa: E402
from pigeon_mta.store.migrate import migrate  # noqa: E402
from pigeon_mta.store.orgs import ensure_org  # noqa: E402
from pigeon_mta.store.upkeep import queue_stats  # noqa: E402

ADMIN_URL = os.environ.get(
    "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)

_LOAD_MESSAGES = """
INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
SELECT gen_random_uuid(), $1, 'bench@example.com', 20, 'Subject: b\r\n\r\nb\r\n'::bytea, 'bench',
       now() - interval '1 day'
FROM generate_series(1, $2)
"""

# Recipient k (1-based) is live (queued, deferred once, due tomorrow) when k <= $3, else delivered.
_LOAD_RECIPIENTS = """
INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts, created_at,
                       next_attempt_at, last_code, last_response)
SELECT gen_random_uuid(), m.id, $1, 'r' || n || '.' || m.k || '@bench.example', 'bench.example',
       CASE WHEN (m.k - 1) * $2 + n <= $3 THEN 'queued' ELSE 'delivered' END, 1, m.received_at,
       CASE WHEN (m.k - 1) * $2 + n <= $3 THEN now() + interval '1 day' ELSE m.received_at END,
       250, 'ok'
FROM (SELECT id, received_at, row_number() OVER () AS k FROM message) m,
     generate_series(1, $2) AS n
"""


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(label: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return (
        f"{label:<34} n={len(ms):<4} p50={statistics.median(ms):7.2f} ms  p95={p(0.95):7.2f} ms  "
        f"p99={p(0.99):7.2f} ms  max={ms[-1]:7.2f} ms"
    )


async def load(url: str, rows: int, live: int, per_message: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn)
        org = await ensure_org(conn, "bench")
        started = time.perf_counter()
        await conn.execute(_LOAD_MESSAGES, org, rows // per_message)
        await conn.execute(_LOAD_RECIPIENTS, org, per_message, live)
        await conn.execute("VACUUM ANALYZE message")
        await conn.execute("VACUUM ANALYZE recipient")
        count = await conn.fetchval("SELECT count(*) FROM recipient")
        print(
            f"loaded {count} recipient rows ({live} live) in {time.perf_counter() - started:.1f}s"
        )
    finally:
        await conn.close()


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def scrape_bench(url: str, processes: int, scrapes: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="pigeon-observe-bench-"))
    port = free_port()
    config = work / "pigeon.toml"
    write_config(
        config,
        f'listener = []\n[server]\ndata_dir = "{work}"\nnode_name = "observe-bench"\n'
        f'[database]\nurl = "{url}"\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
        f'stats_interval = "1s"\n[delivery]\nrelayhost = "127.0.0.1:{free_port()}"\n'
        '[log]\ndelivery_log = ""\nlevel = "warning"\n',
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIGEON_LOG_LEVEL": ""}
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pigeon_mta",
            "serve",
            "--config",
            str(config),
            "--processes",
            str(processes),
        ],
        cwd=REPO,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if get(port, "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit("serve did not become ready")
            time.sleep(0.2)
        time.sleep(2)  # let the stats query publish the queue gauges
        status, body = get(port, "/metrics")
        assert status == 200
        gauges = [line for line in body.decode().splitlines() if line.startswith("pigeon_queue")]
        print("queue gauges as scraped:", "; ".join(gauges))
        print(f"/metrics body: {len(body)} bytes, {len(body.splitlines())} lines")
        for path in ("/metrics", "/readyz"):
            times = []
            for _ in range(scrapes):
                started = time.perf_counter()
                status, _body = get(port, path)
                times.append(time.perf_counter() - started)
                assert status == 200
            print(summary(f"GET {path} ({processes} processes)", times))
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)


async def stats_bench(url: str, repeats: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        made_due = await conn.execute(
            """UPDATE recipient SET next_attempt_at = now() - interval '10 minutes'
               WHERE id IN (SELECT id FROM recipient WHERE status = 'queued' AND random() < 0.5)"""
        )
        await conn.execute("VACUUM ANALYZE recipient")
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            stats = await queue_stats(conn)
            times.append(time.perf_counter() - started)
        print(f"stats after making {made_due.split()[-1]} live rows due: {stats}")
        print(summary("queue_stats (feeds the gauges)", times))
    finally:
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="recipient rows")
    parser.add_argument("--live", type=int, default=50_000, help="of which queued")
    parser.add_argument("--per-message", type=int, default=10, help="recipients per message")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()

    name = f"pigeon_bench_observe_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN_URL)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(ADMIN_URL, name)
    try:
        await load(url, args.rows, args.live, args.per_message)
        await asyncio.to_thread(scrape_bench, url, args.processes, args.scrapes)
        await stats_bench(url, 20)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
