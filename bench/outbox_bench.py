"""The outbox relay: how many rows per second one outbox turns into queued mail, on two scratch
databases it creates (and drops): the application's, with --rows rows in its outbox (the HTTP
API's JSON form, one recipient each, as an application's order confirmations), and pigeon-mta's.

One OutboxRelay per --processes (each on its own event loop in its own process, as each worker
runs one) relays batches of --batch rows until none is left: claim FOR UPDATE SKIP LOCKED, the
keys' queue ids, the intake (composition from JSON, sender policy, fixups, lane), the group
commit, the write-back. Reported: rows per second from the first claim to the last commit, the
CPU seconds of the relay processes, and a check that every row was queued once. Delivery is not
part of it (bench/e2e.py measures that). Bounded in count; loopback only.

    .venv/bin/python bench/outbox_bench.py [--rows 20000] [--processes 2] [--batch 200]
        [--url postgresql://postgres@127.0.0.1/postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import platform
import resource
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pigeon_mta.config import OutboxSettings, Settings  # noqa: E402
from pigeon_mta.intake.accept import Intake  # noqa: E402
from pigeon_mta.outbox.relay import OutboxRelay  # noqa: E402
from pigeon_mta.outbox.table import ddl  # noqa: E402
from pigeon_mta.store.domains import add_sender_domain  # noqa: E402
from pigeon_mta.store.migrate import migrate  # noqa: E402
from pigeon_mta.store.orgs import ensure_org  # noqa: E402


def with_db(url: str, name: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, "/" + name, p.query, ""))


async def prepare(pigeon_url: str, app_url: str, rows: int) -> None:
    conn = await asyncpg.connect(pigeon_url)
    try:
        await migrate(conn)
        org = await ensure_org(conn, "bench")
        await add_sender_domain(conn, org, "bench.example")
    finally:
        await conn.close()
    conn = await asyncpg.connect(app_url)
    try:
        await conn.execute(ddl("pigeon_outbox"))
        await conn.execute(
            """INSERT INTO pigeon_outbox (idempotency_key, message)
               SELECT 'order-' || n, jsonb_build_object(
                   'from', 'shop@bench.example', 'to', jsonb_build_array('buyer' || n || '@dest.example'),
                   'subject', 'Your order ' || n, 'text', repeat('Thank you for your order. ', 40))
               FROM generate_series(1, $1::int) AS n""",
            rows,
        )
    finally:
        await conn.close()


def worker(pigeon_url: str, app_url: str, batch: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> tuple[float, float, int]:
        outbox = OutboxSettings(name="bench", database=app_url, org="bench", batch=batch)
        settings = dataclasses.replace(Settings(), outbox=(outbox,))
        pool = await asyncpg.create_pool(pigeon_url, min_size=2, max_size=6)
        app = await asyncpg.connect(app_url)
        try:
            relay = OutboxRelay(settings, outbox, pool, Intake.of(settings, pool))
            first = last = 0.0
            done = 0
            while True:
                started = time.time()
                result = await relay.relay_round(app)
                if not result.taken:
                    break
                first = first or started
                last = time.time()
                done += len(result.relayed)
            return first, last, done
        finally:
            await app.close()
            await pool.close()

    first, last, done = asyncio.run(run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((first, last, done, usage.ru_utime + usage.ru_stime))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    names = [f"pigeon_outbox_bench_{os.getpid()}", f"pigeon_outbox_bench_app_{os.getpid()}"]
    admin = await asyncpg.connect(args.url)
    for name in names:
        await admin.execute(f'CREATE DATABASE "{name}"')
    pigeon_url, app_url = (with_db(args.url, name) for name in names)
    try:
        await prepare(pigeon_url, app_url, args.rows)
        out: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        procs = [
            multiprocessing.Process(target=worker, args=(pigeon_url, app_url, args.batch, out))
            for _ in range(args.processes)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        first = min(r[0] for r in results if r[2])
        last = max(r[1] for r in results)
        done = sum(r[2] for r in results)
        cpu = sum(r[3] for r in results)
        conn = await asyncpg.connect(pigeon_url)
        queued = await conn.fetchval(
            "SELECT count(DISTINCT header_message_id) FROM message WHERE listener = 'outbox'"
        )
        messages = await conn.fetchval("SELECT count(*) FROM message")
        await conn.close()
        report = {
            "host": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "rows": args.rows,
            "processes": args.processes,
            "batch": args.batch,
            "rows_per_second": round(done / (last - first), 1),
            "cpu_ms_per_row": round(cpu * 1000 / max(done, 1), 3),
            "messages_queued": messages,
        }
        print(json.dumps(report, indent=2))
        if messages != args.rows or queued != args.rows:
            sys.exit(f"{messages} messages queued ({queued} distinct) for {args.rows} rows")
    finally:
        for name in names:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
