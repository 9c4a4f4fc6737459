"""Admin commands at a million rows: every `queue`, `log` and `suppress list` query and one
retention purge batch, timed on a database the size of a busy node's month.

It builds, in a scratch database on the server given by --url, about 1.09M recipients (1.04M of
them finished history over 30 days, 50k live: queued, deferred, being delivered), 1.8M attempt
rows, 55k suppression entries (30k of them made by a bounce, pointing at its attempt) and one
address with 20,000 messages; then it times each admin query the way the CLI runs it (the store
function it calls, on a connection with the service's session settings) and the retention purge
of one batch of 1,000 messages (in a transaction rolled back, so that every run deletes the same
batch). It drops the database at the end.

    .venv/bin/python bench/admin_bench.py [--url postgresql://postgres@127.0.0.1/postgres]
        [--runs 5] [--scale 1.0] [--keep NAME]

--keep NAME builds the database under that name once and keeps it: a later run with the same name
reuses it (and applies any new migration first, timed), for A/B runs while changing a query. Drop
it with `DROP DATABASE NAME` when done.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pigeon_mta.config import Settings
from pigeon_mta.store import admin_queue, events, queue_summary, suppression, upkeep
from pigeon_mta.store.admin_queue import Selection
from pigeon_mta.store.connect import server_settings
from pigeon_mta.store.migrate import migrate
from pigeon_mta.store.orgs import ensure_org

# The session settings of the CLI's and the service's connections: custom plans, no JIT, and the
# service's statement_timeout (10 s), which a purge batch has to finish within.
SERVICE = server_settings(Settings())

HOT_ADDRESS = "hot@big.example"  # the address with 20,000 messages
HOT_TYPED = "Hot@Big.Example"  # as an operator might type it: three spellings to look up
SLOW_DOMAIN = "slow3.example"  # one of the 20 domains with deferred recipients (750 each)
LIST_DOMAIN = "d42.example"  # one of the 500 domains of fresh mail
RETENTION = 7 * 86400.0  # the purge deletes finished messages older than this
LIMIT_MS = 50.0  # every admin query but `queue --exact`
PURGE_LIMIT_MS = 1000.0


def with_db(url: str, name: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, "/" + name, p.query, ""))


def uuid7(ts: str) -> str:
    """SQL for a UUIDv7-like id made at timestamp expression `ts` (milliseconds first, then
    random, as pigeon_mta.ids makes them): the purge selects old messages by id."""
    return (
        "encode(overlay(uuid_send(gen_random_uuid()) placing "
        f"substring(int8send(floor(extract(epoch from {ts}) * 1000)::bigint) from 3) "
        "from 1 for 6), 'hex')::uuid"
    )


# ---------------------------------------------------------------- the database

# Finished history: n = 1..$2 spread over 30 days, oldest first, ending an hour ago. 95% delivered,
# 3% bounced, 1% expired, 1% cancelled; 70% deferred once before their last attempt. Every 52nd
# message goes to HOT_ADDRESS (20,000 of 1,040,000), the others to one address each over 500
# domains.
_HISTORY = f"""
CREATE UNLOGGED TABLE bench_history AS
SELECT n, t, {uuid7("t")} AS message_id, {uuid7("t")} AS recipient_id,
       {uuid7("t + interval '1 minute'")} AS first_attempt, {uuid7("t + interval '1 hour'")} AS last_attempt,
       CASE WHEN n % 100 < 95 THEN 'delivered' WHEN n % 100 < 98 THEN 'bounced'
            WHEN n % 100 < 99 THEN 'expired' ELSE 'cancelled' END AS status,
       CASE WHEN n % 52 = 7 THEN '{HOT_ADDRESS}' ELSE 'u' || n || '@d' || n % 500 || '.example'
            END AS address,
       CASE WHEN n % 52 = 7 THEN 'big.example' ELSE 'd' || n % 500 || '.example' END AS domain,
       n % 10 < 7 AS deferred_once
FROM (SELECT n, now() - interval '31 days' + n * (interval '30 days' / $N) AS t
      FROM generate_series(1, $N) AS n) s
"""

_HISTORY_MESSAGES = """
INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener, received_at)
SELECT message_id, $1, 'sender@bench.example', 'bench.' || n || '@bench.example', 20,
       'Subject: b\r\n\r\nb\r\n', 'bench', t
FROM bench_history ORDER BY message_id
"""

_HISTORY_RECIPIENTS = """
INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts, created_at,
                       next_attempt_at, last_code, last_enhanced_code, last_response, updated_at)
SELECT recipient_id, message_id, $1, address, domain, status, 1 + deferred_once::int, t, t,
       CASE status WHEN 'delivered' THEN 250 WHEN 'bounced' THEN 550 END,
       CASE status WHEN 'delivered' THEN '2.0.0' WHEN 'bounced' THEN '5.1.1' END,
       CASE status WHEN 'delivered' THEN 'ok' WHEN 'bounced' THEN 'no such user' END,
       t + interval '1 hour'
FROM bench_history ORDER BY recipient_id
"""

_HISTORY_ATTEMPTS = """
INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, mx_host, code,
                     enhanced_code, response, outcome, next_attempt_at)
SELECT first_attempt, recipient_id, message_id, $1::uuid, 1, t + interval '1 minute', 'mx.example',
       451, '4.0.0', 'try later', 'deferred', t + interval '1 hour'
FROM bench_history WHERE deferred_once
UNION ALL
SELECT last_attempt, recipient_id, message_id, $1::uuid, 1 + deferred_once::int, t + interval '1 hour',
       'mx.example', CASE status WHEN 'delivered' THEN 250 WHEN 'bounced' THEN 550 END, NULL,
       CASE status WHEN 'delivered' THEN 'ok' WHEN 'bounced' THEN 'no such user' ELSE 'gave up' END,
       status, NULL
FROM bench_history
"""

# Every bounce suppressed its address, pointing at its attempt; the rest of the list was added by
# hand.
_SUPPRESSIONS = f"""
INSERT INTO suppression (id, org_id, address, reason, source, attempt_id, created_at)
SELECT {uuid7("t")}, $1::uuid, address, '550 5.1.1 no such user', 'bounce', last_attempt,
       t + interval '1 hour'
FROM bench_history WHERE status = 'bounced' AND address <> '{HOT_ADDRESS}'
UNION ALL
SELECT {uuid7("now()")}, $1::uuid, 'm' || k || '@manual.example', 'by hand', 'manual', NULL,
       now() - k * interval '1 minute'
FROM generate_series(1, $2) AS k
"""

# The live queue, made in the last hour: fresh mail over 500 domains (half due, half not yet),
# deferred mail to 20 slow domains (1-3 attempts each), and rows being delivered under a lease.
_LIVE = f"""
WITH live AS (
    SELECT k, now() - interval '1 hour' + k * (interval '1 hour' / $2) AS t,
           CASE WHEN k % 10 < 6 THEN 'fresh' WHEN k % 10 < 9 THEN 'deferred' ELSE 'delivering'
                END AS kind
    FROM generate_series(1, $2) AS k
), rows AS (
    SELECT k, t, kind, {uuid7("t")} AS message_id, {uuid7("t")} AS recipient_id,
           CASE kind WHEN 'deferred' THEN 'slow' || k / 10 % 20 || '.example'
                     ELSE 'd' || k % 500 || '.example' END AS domain
    FROM live
), m AS (
    INSERT INTO message (id, org_id, sender, header_message_id, size, body, listener, received_at)
    SELECT message_id, $1, 'sender@bench.example', 'live.' || k || '@bench.example', 20,
           'Subject: b\r\n\r\nb\r\n', 'bench', t
    FROM rows
), r AS (
    INSERT INTO recipient (id, message_id, org_id, address, domain, status, attempts, created_at,
                           next_attempt_at, lease_until, lease_owner, last_code, updated_at)
    SELECT recipient_id, message_id, $1, 'v' || k || '@' || domain, domain,
           CASE kind WHEN 'delivering' THEN 'delivering' ELSE 'queued' END,
           CASE kind WHEN 'deferred' THEN 1 + k % 3 WHEN 'delivering' THEN 1 ELSE 0 END, t,
           CASE WHEN kind = 'deferred' OR k % 2 = 0 THEN now() + interval '30 minutes' ELSE t END,
           CASE kind WHEN 'delivering' THEN now() + interval '5 minutes' END,
           CASE kind WHEN 'delivering' THEN 'bench' END,
           CASE kind WHEN 'deferred' THEN 451 END, t
    FROM rows
)
INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, code, response,
                     outcome, next_attempt_at)
SELECT {uuid7("t")}, recipient_id, message_id, $1, a, t + a * interval '1 minute', 451,
       'try later', 'deferred', now() + interval '30 minutes'
FROM rows, generate_series(1, 1 + k % 3) AS a
WHERE kind = 'deferred'
"""


async def build(conn: asyncpg.Connection, scale: float) -> None:
    org_id = await ensure_org(conn, "bench")
    history = int(1_040_000 * scale)
    steps: list[tuple[str, str, tuple[Any, ...]]] = [
        # CREATE TABLE AS takes no parameters: the row count goes in as a literal.
        ("history", _HISTORY.replace("$N", str(history)), ()),
        ("messages", _HISTORY_MESSAGES, (org_id,)),
        ("recipients", _HISTORY_RECIPIENTS, (org_id,)),
        ("attempts", _HISTORY_ATTEMPTS, (org_id,)),
        ("suppression", _SUPPRESSIONS, (org_id, int(25_000 * scale))),
        ("live queue", _LIVE, (org_id, int(50_000 * scale))),
    ]
    for label, sql, args in steps:
        began = time.monotonic()
        await conn.execute(sql, *args)
        print(f"  built {label} in {time.monotonic() - began:.1f} s", flush=True)
    await conn.execute("DROP TABLE bench_history")
    began = time.monotonic()
    for table in ("message", "recipient", "attempt", "suppression"):
        await conn.execute(f"VACUUM ANALYZE {table}")
    await conn.execute("CHECKPOINT")
    print(f"  vacuumed and analyzed in {time.monotonic() - began:.1f} s", flush=True)


async def sizes(conn: asyncpg.Connection) -> dict[str, int]:
    return {
        table: int(await conn.fetchval(f"SELECT count(*) FROM {table}"))
        for table in ("message", "recipient", "attempt", "suppression")
    }


# ---------------------------------------------------------------- the commands


async def purge_batch(conn: asyncpg.Connection) -> int:
    """One retention batch (1,000 messages), rolled back so that each run deletes the same."""
    tx = conn.transaction()
    await tx.start()
    try:
        purged = await upkeep.purge_finished_messages(conn, older_than=RETENTION, limit=1000)
    finally:
        await tx.rollback()
    if purged != 1000:
        raise RuntimeError(f"the purge batch deleted {purged} messages, not 1,000")
    return purged


async def commands(conn: asyncpg.Connection) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    """(the command as an operator types it, the store call it makes)."""
    message_id = await conn.fetchval(
        "SELECT message_id FROM recipient WHERE status = 'bounced' "
        "AND created_at > now() - interval '3 days' LIMIT 1"
    )
    recipient_id = await conn.fetchval("SELECT id FROM recipient WHERE message_id = $1", message_id)
    header_id = await conn.fetchval(
        "SELECT header_message_id FROM message WHERE id = $1", message_id
    )
    live_id = await conn.fetchval(
        "SELECT message_id FROM recipient WHERE domain = $1 LIMIT 1", SLOW_DOMAIN
    )
    return [
        ("queue", lambda: queue_summary.queue_summary(conn)),
        ("queue --exact", lambda: queue_summary.queue_summary(conn, exact=True)),
        ("queue list", lambda: admin_queue.list_recipients(conn, Selection())),
        (
            "queue list --status deferred",
            lambda: admin_queue.list_recipients(conn, Selection(statuses=("deferred",))),
        ),
        (
            f"queue list --domain {LIST_DOMAIN}",
            lambda: admin_queue.list_recipients(conn, Selection(domain=LIST_DOMAIN)),
        ),
        (
            f"queue list --status deferred --domain {SLOW_DOMAIN}",
            lambda: admin_queue.list_recipients(
                conn, Selection(statuses=("deferred",), domain=SLOW_DOMAIN)
            ),
        ),
        ("queue show QUEUE_ID", lambda: admin_queue.show(conn, message_id)),
        ("queue show RECIPIENT_ID", lambda: admin_queue.show(conn, recipient_id)),
        (
            # `queue retry` by a filter retries deferred rows only (commands/queue.py).
            f"queue retry --domain {SLOW_DOMAIN} --dry-run",
            lambda: admin_queue.bulk_action(
                conn,
                "retry",
                Selection(statuses=("deferred",), domain=SLOW_DOMAIN),
                dry_run=True,
            ),
        ),
        (
            "queue retry QUEUE_ID --dry-run",
            lambda: admin_queue.bulk_action(conn, "retry", Selection(ids=(live_id,)), dry_run=True),
        ),
        (
            "queue cancel --all --dry-run",
            lambda: admin_queue.bulk_action(conn, "cancel", Selection(), dry_run=True),
        ),
        (
            f"queue cancel --domain {LIST_DOMAIN} --dry-run",
            lambda: admin_queue.bulk_action(
                conn, "cancel", Selection(domain=LIST_DOMAIN), dry_run=True
            ),
        ),
        ("log QUEUE_ID", lambda: events.find_stories(conn, str(message_id), limit=10)),
        ("log MESSAGE_ID", lambda: events.find_stories(conn, f"<{header_id}>", limit=10)),
        (
            f"log {HOT_TYPED} (20,000 messages)",
            lambda: events.find_stories(conn, HOT_TYPED, limit=10),
        ),
        ("suppress list", lambda: suppression.list_suppressions(conn, limit=1000)),
        ("retention purge, one batch of 1,000 messages", lambda: purge_batch(conn)),
    ]


async def timed(call: Callable[[], Awaitable[Any]], runs: int) -> tuple[list[float], str]:
    """Milliseconds of each run after one unmeasured warm-up run, or a note if it failed."""
    times: list[float] = []
    for i in range(runs + 1):
        began = time.perf_counter()
        try:
            await call()
        except asyncpg.QueryCanceledError:
            return times, "cancelled by statement_timeout"
        if i:
            times.append((time.perf_counter() - began) * 1000)
    return times, ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--runs", type=int, default=5, help="measured runs per command (5)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the row counts")
    parser.add_argument("--keep", metavar="NAME", help="build into NAME once, reuse and keep it")
    args = parser.parse_args()
    name = args.keep or f"pigeon_admin_bench_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    exists = await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
    if not exists:
        await admin.execute(f'CREATE DATABASE "{name}"')
    url = with_db(args.url, name)
    failed = False
    try:
        # Each building statement is bounded (on the 2-core host the longest took 3.5 min).
        conn = await asyncpg.connect(url, server_settings=SERVICE, command_timeout=900)
        await conn.execute("SET statement_timeout = 0")
        began = time.monotonic()
        applied = await migrate(conn)
        if exists and applied:
            names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
            print(f"  applied {names} in {time.monotonic() - began:.1f} s", flush=True)
            await conn.execute("ANALYZE")
        if not exists or not await conn.fetchval("SELECT EXISTS (SELECT FROM attempt)"):
            print(f"building {name} (scale {args.scale})", flush=True)
            await build(conn, args.scale)
        rows = await sizes(conn)
        await conn.execute(f"SET statement_timeout = {SERVICE['statement_timeout']}")
        results = []
        for command, call in await commands(conn):
            times, note = await timed(call, args.runs)
            results.append((command, times, note))
        await conn.close()
    finally:
        if not args.keep:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()

    load = os.getloadavg()
    print(
        f"# admin_bench {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
        f"nproc {os.cpu_count()}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(
        "# rows: "
        + ", ".join(f"{table} {count:,}" for table, count in rows.items())
        + f"; {args.runs} runs after a warm-up"
    )
    print("| command | median ms | max ms | limit |")
    print("|---|---:|---:|---|")
    for command, times, note in results:
        limit = None if command == "queue --exact" else LIMIT_MS
        if command.startswith("retention purge"):
            limit = PURGE_LIMIT_MS
        if note:
            print(f"| {command} | {note} | | {'OVER ' if limit else ''}< {limit or 0:,.0f} |")
            failed = failed or limit is not None
            continue
        median, worst = statistics.median(times), max(times)
        over = limit is not None and median > limit
        failed = failed or over
        mark = "" if limit is None else f"{'OVER ' if over else ''}< {limit:,.0f}"
        print(f"| {command} | {median:,.1f} | {worst:,.1f} | {mark} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
