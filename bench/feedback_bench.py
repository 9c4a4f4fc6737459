"""Feedback read and applied: how many feedback messages per second the processor turns into
events, on a scratch database it creates (and drops).

--messages delivered recipients are queued (one message each, as a VERP return path makes
them), and for each a feedback message is kept as the feedback listener keeps it: a Postfix-style
DSN (RFC 3464, 5.1.1) to the recipient's VERP address, or (--mix) every fifth an ARF complaint
with the original attached. Then one FeedbackProcessor per --processes (each on its own event
loop in its own process, as each worker runs one) reads them in batches until none is left:
parse off the loop, match by token, one record statement per batch (events, bounced state,
suppression, outbox, status). Reported: messages per second from the first take to the last
commit, the CPU seconds of the processes, and a check that every recipient is bounced and
suppressed. Bounded in count; loopback only.

    .venv/bin/python bench/feedback_bench.py [--messages 20000] [--processes 2] [--mix]
        [--url postgresql://postgres@127.0.0.1/postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import resource
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pigeon_mta.config import Settings  # noqa: E402
from pigeon_mta.feedback.processor import FeedbackProcessor  # noqa: E402
from pigeon_mta.feedback.return_paths import ReturnPaths  # noqa: E402
from pigeon_mta.feedback.tokens import return_path  # noqa: E402
from pigeon_mta.store.domains import add_sender_domain  # noqa: E402
from pigeon_mta.store.migrate import migrate  # noqa: E402
from pigeon_mta.store.orgs import ensure_org  # noqa: E402
from pigeon_mta.store.return_path import set_return_path  # noqa: E402
from tests.peers import feedback_reports as reports  # noqa: E402

RETURN_PATH = "bounces.bench.example"


def with_db(url: str, name: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, "/" + name, p.query, ""))


async def prepare(url: str, count: int, mix: bool) -> None:
    """`count` delivered recipients and one kept feedback message about each."""
    pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
    try:
        org = await ensure_org(pool, "bench")
        await add_sender_domain(pool, org, "bench.example")
        await set_return_path(pool, "bench.example", RETURN_PATH)
        paths = ReturnPaths(Settings(), pool)
        await paths.refresh()
        key = paths.signing
        assert key is not None
        rows = await pool.fetch(
            """WITH m AS (
                   INSERT INTO message (id, org_id, sender, body, size, listener,
                                        header_message_id, received_at)
                   SELECT gen_random_uuid(), $1, 'app@bench.example', 'x', 1, 'bench',
                          'm' || n || '@bench.example', now()
                   FROM generate_series(1, $2) AS n
                   RETURNING id, header_message_id)
               INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts,
                                      created_at, next_attempt_at)
               SELECT gen_random_uuid(), m.id, $1,
                      'user' || split_part(m.header_message_id, '@', 1) || '@dest.example',
                      'dest.example', 'delivered', 1, now(), now()
               FROM m
               RETURNING id, address""",
            org,
            count,
        )
        kept = []
        for i, row in enumerate(rows):
            verp = return_path(key, row["id"], RETURN_PATH)
            if mix and i % 5 == 4:
                body = reports.arf(
                    to=verp,
                    return_path=verp,
                    recipient_in_original=row["address"],
                    report_id=f"arf-{i}@reports.example",
                )
            else:
                body = reports.dsn(
                    to=verp, recipient=row["address"], report_id=f"dsn-{i}@mx.dest.example"
                )
            kept.append((str(uuid.uuid4()), f"mid:bench-{i}", [verp], body))
        await pool.executemany(
            """INSERT INTO feedback (id, report_key, listener, mail_from, rcpt_to, body)
               VALUES ($1::uuid, $2, 'feedback', '', $3, $4)""",
            kept,
        )
    finally:
        await pool.close()


def worker(url: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> tuple[float, float, int]:
        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        try:
            paths = ReturnPaths(Settings(), pool)
            await paths.refresh()
            processor = FeedbackProcessor(pool, paths)
            first = last = 0.0
            done = 0
            while True:
                started = time.time()
                n = await processor.process()
                if n == 0:
                    break
                first = first or started
                last = time.time()
                done += n
            return first, last, done
        finally:
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
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--mix", action="store_true", help="every fifth is an ARF complaint")
    args = parser.parse_args()
    name = f"pigeon_feedback_bench_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = with_db(args.url, name)
    try:
        conn = await asyncpg.connect(url)
        await migrate(conn)
        await conn.close()
        await prepare(url, args.messages, args.mix)
        out: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        procs = [
            multiprocessing.Process(target=worker, args=(url, out)) for _ in range(args.processes)
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
        conn = await asyncpg.connect(url)
        checked = await conn.fetchrow(
            """SELECT (SELECT count(*) FROM recipient WHERE status = 'bounced') AS bounced,
                      (SELECT count(*) FROM suppression) AS suppressed,
                      (SELECT count(*) FROM feedback WHERE status = 'applied') AS applied,
                      (SELECT count(*) FROM feedback_event) AS events"""
        )
        await conn.close()
        report = {
            "host": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "messages": args.messages,
            "processes": args.processes,
            "mix": args.mix,
            "read_and_applied_per_second": round(done / (last - first), 1),
            "cpu_ms_per_message": round(cpu * 1000 / max(done, 1), 3),
            **dict(checked),
        }
        print(json.dumps(report, indent=2))
        expected_bounced = args.messages - (args.messages // 5 if args.mix else 0)
        if checked["applied"] != args.messages or checked["bounced"] != expected_bounced:
            sys.exit("not every feedback message was applied")
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
