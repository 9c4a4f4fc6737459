"""Queue benchmark: enqueue rate, claim + record rate, and claim rate on a large table.

Runs against a scratch database it creates (and drops) on the server given by --url (default: the
local PostgreSQL on 127.0.0.1:5432). Every phase is bounded in count and time.

    .venv/bin/python bench/queue_bench.py [--url postgresql://postgres@127.0.0.1/postgres] [--quick]
        [--part enqueue|claim-record|large-table|fair|deferred]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from pigeon_mta.store import outcomes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pigeon_mta.config import Settings
from pigeon_mta.ids import new_id
from pigeon_mta.model import AttemptResult, Envelope, Outcome, Reply
from pigeon_mta.outbound.claims import group_deliveries
from pigeon_mta.store import claims, queue
from pigeon_mta.store.connect import server_settings
from pigeon_mta.store.duplicates import enqueue_submitted
from pigeon_mta.store.group_commit import MAX_COMMITS, GroupCommit
from pigeon_mta.store.migrate import migrate
from pigeon_mta.store.orgs import ensure_org

# The session settings of the service's own connections (custom plans, no JIT, its timeout), and
# of a worker's commit pool, on which the submission path writes messages (generic plans).
SERVICE = server_settings(Settings())
COMMITS = server_settings(Settings(), generic_plans=True)
# The claim's lane weights with the built-in lanes, as the engine passes them.
LANE_WEIGHTS = {name: lane.weight for name, lane in Settings().lanes.items()}

BODY = (
    b"From: bench@example.com\r\nTo: rcpt@example.net\r\nSubject: bench\r\n\r\n"
    + (b"x" * 76 + b"\r\n") * 64
)[:5120]


def bench_envelope(org_id: uuid.UUID, *, checked: bool) -> Envelope:
    """One 5 KB message to one recipient; `checked`: with a Message-ID of its own (each one new)
    and the default limits.duplicate_window, as most applications' mail is submitted."""
    if not checked:
        return Envelope(org_id, "bench@example.com", ("rcpt@example.net",), BODY, "bench")
    return Envelope(
        org_id,
        "bench@example.com",
        ("rcpt@example.net",),
        BODY,
        "bench",
        header_message_id=f"{uuid.uuid4().hex}@bench.example",
        duplicate_window=Settings().limits.duplicate_window,
    )


def with_db(url: str, name: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, "/" + name, p.query, ""))


async def enqueue_rate(
    url: str,
    org_id: uuid.UUID,
    connections: int,
    count: int,
    seconds: float,
    *,
    notify: bool = True,
    checked: bool = False,
) -> float:
    # With NOTIFY: the engine's DSNs, on its main pool; without: the submission path's commits.
    session = SERVICE if notify else COMMITS
    conns = [await asyncpg.connect(url, server_settings=session) for _ in range(connections)]
    per = count // connections
    deadline = time.monotonic() + seconds

    async def run(conn: asyncpg.Connection) -> int:
        done = 0
        while done < per and time.monotonic() < deadline:
            envelope = bench_envelope(org_id, checked=checked)
            if checked:
                await enqueue_submitted(conn, [(new_id(), envelope)])
            else:
                await queue.enqueue(conn, envelope, notify=notify)
            done += 1
        return done

    began = time.monotonic()
    done = sum(await asyncio.gather(*(run(c) for c in conns)))
    elapsed = time.monotonic() - began
    for c in conns:
        await c.close()
    return done / elapsed


async def group_commit_rate(
    url: str, org_id: uuid.UUID, sessions: int, count: int, seconds: float, *, checked: bool = False
) -> float:
    """The submission path as it runs: `sessions` concurrent callers, each committing one message
    at a time through one process's GroupCommit on its commit pool (store.connect.commit_pool)."""
    pool = await asyncpg.create_pool(
        url, min_size=MAX_COMMITS, max_size=MAX_COMMITS, server_settings=COMMITS
    )
    assert pool is not None
    group = GroupCommit(pool)
    per = count // sessions
    deadline = time.monotonic() + seconds

    async def run() -> int:
        done = 0
        while done < per and time.monotonic() < deadline:
            await group.enqueue(new_id(), bench_envelope(org_id, checked=checked))
            done += 1
        return done

    began = time.monotonic()
    done = sum(await asyncio.gather(*(run() for _ in range(sessions))))
    elapsed = time.monotonic() - began
    await pool.close()
    return done / elapsed


# UUIDv7-like ids made in SQL (PostgreSQL 15 has no uuidv7()): milliseconds first, then random,
# as pigeon_mta.ids makes them, so that the indexes see the service's insert pattern.
UUID7 = (
    "encode(overlay(uuid_send(gen_random_uuid()) placing "
    "substring(int8send(floor(extract(epoch from clock_timestamp()) * 1000)::bigint) from 3) "
    "from 1 for 6), 'hex')::uuid"
)


async def load_due(
    conn: asyncpg.Connection,
    org_id: uuid.UUID,
    n: int,
    *,
    status: str = "queued",
    due_in: float = 0,
    lane: str = "transactional",
) -> None:
    await conn.execute(
        f"""
        WITH m AS (
            INSERT INTO message (id, org_id, sender, size, body, listener, lane)
            SELECT {UUID7}, $1, 'bench@example.com', 20, 'Subject: b\r\n\r\nb\r\n', 'bench', $5
            FROM generate_series(1, $2) RETURNING id, received_at)
        INSERT INTO recipient (id, message_id, org_id, address, domain, status, created_at,
                               next_attempt_at, lane)
        SELECT {UUID7}, m.id, $1, 'r' || left(m.id::text, 13) || '@d' || (hashtext(m.id::text) % 500) || '.example',
               'd' || (hashtext(m.id::text) % 500) || '.example', $3, m.received_at,
               now() + make_interval(secs => $4), $5
        FROM m""",
        org_id,
        n,
        status,
        due_in,
        lane,
    )


async def settle(conn: asyncpg.Connection) -> None:
    """What autovacuum and the checkpointer would do after a bulk load, done before the clock
    starts: otherwise they run during one measurement and not the other (a 1.2M-row load makes
    autovacuum scan `message` and a checkpoint flush it), which compares background work, not
    the claim. Both the empty-table and the large-table figures are taken after this."""
    await conn.execute("VACUUM ANALYZE recipient")
    await conn.execute("VACUUM ANALYZE message")
    await conn.execute("CHECKPOINT")


async def claim_record_rate(
    url: str, workers: int, count: int, seconds: float, *, record: bool = True
) -> float:
    taken, began, ended = await claim_record(url, workers, count, seconds, record=record)
    return taken / (ended - began)


async def claim_record(
    url: str,
    workers: int,
    count: int,
    seconds: float,
    *,
    record: bool = True,
    barrier: Any = None,
) -> tuple[int, float, float]:
    """Claim (and record delivered) up to `count` recipients on `workers` connections; returns
    (recipients, start, end) in Unix time. With a barrier, the clock starts once every party has
    connected."""
    conns = [await asyncpg.connect(url, server_settings=SERVICE) for _ in range(workers)]
    if barrier is not None:
        await asyncio.to_thread(barrier.wait, 60)
    deadline = time.monotonic() + seconds
    taken = [0] * workers

    async def run(i: int, conn: asyncpg.Connection) -> None:
        while sum(taken) < count and time.monotonic() < deadline:
            claimed = await claims.claim_due_recipients(
                conn, owner=f"bench-{i}", lease=300, batch=100, lane_weights=LANE_WEIGHTS
            )
            batch = group_deliveries(claimed.rows)
            if not batch:
                return
            if record:
                now = datetime.now(UTC)
                await outcomes.record_outcomes(
                    conn,
                    [
                        AttemptResult(
                            r.id,
                            d.queue_id,
                            d.org_id,
                            r.attempts,
                            Outcome.DELIVERED,
                            Reply(250, "2.0.0", "ok"),
                            now,
                            0.001,
                            mx_host="mx",
                            ip="127.0.0.1",
                            port=25,
                        )
                        for d in batch
                        for r in d.recipients
                    ],
                )
            taken[i] += sum(len(d.recipients) for d in batch)

    began = time.time()
    await asyncio.gather(*(run(i, c) for i, c in enumerate(conns)))
    ended = time.time()
    for c in conns:
        await c.close()
    return sum(taken), began, ended


def _claim_record_child(
    url: str, workers: int, count: int, seconds: float, barrier: Any, out: Any
) -> None:
    out.put(asyncio.run(claim_record(url, workers, count, seconds, barrier=barrier)))


def claim_record_rate_processes(
    url: str, processes: int, workers: int, count: int, seconds: float
) -> float:
    """claim_record in `processes` processes at once (as `serve --processes N` runs its engines),
    all starting once every one has connected: one Python process driving every connection
    measures that process's event loop and its hand-offs, not PostgreSQL (4 connections in one
    process: 9,678/s; in 2 processes with 2 each: 10,822/s, on one host, interleaved). The rate is all the
    recipients over the span from the first start to the last end."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    barrier = context.Barrier(processes)
    children = [
        context.Process(
            target=_claim_record_child,
            args=(url, workers, count // processes, seconds, barrier, out),
        )
        for _ in range(processes)
    ]
    try:
        for child in children:
            child.start()
        runs = [out.get(timeout=seconds + 120) for _ in children]
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.terminate()
                child.join(10)
    taken = sum(r[0] for r in runs)
    return taken / (max(r[2] for r in runs) - min(r[1] for r in runs))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts (a smoke run)")
    parser.add_argument(
        "--part",
        choices=["enqueue", "claim-record", "large-table", "fair", "deferred", "all"],
        default="all",
        help="run one part only (for A/B runs of a change)",
    )
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    name = f"pigeon_bench_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = with_db(args.url, name)
    results: list[tuple[str, str]] = []
    try:
        conn = await asyncpg.connect(url)
        await migrate(conn)
        org_id = await ensure_org(conn, "bench")
        fsync = await conn.fetchval("SHOW fsync")
        sync_commit = await conn.fetchval("SHOW synchronous_commit")

        for notify in (True, False) if args.part in ("enqueue", "all") else ():
            for connections, target in ((1, "2,000"), (16, "6,000")):
                rate = await enqueue_rate(
                    url, org_id, connections, int(20000 * scale), 15, notify=notify
                )
                how = "NOTIFY in the transaction" if notify else "no NOTIFY (submission path)"
                results.append(
                    (
                        f"enqueue 5 KB, 1 recipient, {connections} connection(s), {how}",
                        f"{rate:,.0f} msgs/s (target >= {target})",
                    )
                )
        if args.part in ("enqueue", "all"):
            rate = await group_commit_rate(url, org_id, 20, int(40000 * scale), 15)
            results.append(
                (
                    "enqueue 5 KB, 1 recipient, 20 sessions through one process's GroupCommit "
                    f"({MAX_COMMITS} connections), the submission path as it runs",
                    f"{rate:,.0f} msgs/s (target >= 6,000 over 16 connections)",
                )
            )
            # The same paths for messages with a Message-ID of their own, checked against
            # limits.duplicate_window (store/duplicates.py); none is a duplicate.
            for connections in (1, 16):
                rate = await enqueue_rate(
                    url, org_id, connections, int(20000 * scale), 15, notify=False, checked=True
                )
                results.append(
                    (
                        f"enqueue 5 KB, 1 recipient, {connections} connection(s), submission path, "
                        "duplicate check",
                        f"{rate:,.0f} msgs/s",
                    )
                )
            rate = await group_commit_rate(url, org_id, 20, int(40000 * scale), 15, checked=True)
            results.append(
                (
                    "enqueue 5 KB, 1 recipient, 20 sessions through one process's GroupCommit, "
                    "duplicate check",
                    f"{rate:,.0f} msgs/s",
                )
            )
            await conn.execute("TRUNCATE message, recipient, attempt CASCADE")
        if args.part in ("claim-record", "all"):
            await claim_record_part(conn, url, org_id, scale, results)
        if args.part in ("large-table", "all"):
            await large_table_part(conn, url, org_id, scale, results)
        if args.part in ("fair", "all"):
            await fair_part(conn, url, org_id, scale, results)
        if args.part in ("deferred", "all"):
            await deferred_part(conn, url, org_id, scale, results)
        await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()

    print(
        f"# queue_bench {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, "
        f"PostgreSQL fsync={fsync} synchronous_commit={sync_commit}{' (quick)' if args.quick else ''}"
    )
    for what, figure in results:
        print(f"| {what} | {figure} |")


async def claim_record_part(
    conn: asyncpg.Connection,
    url: str,
    org_id: uuid.UUID,
    scale: float,
    results: list[tuple[str, str]],
) -> None:
    n = int(200_000 * scale)
    await load_due(conn, org_id, n)
    await conn.execute("VACUUM ANALYZE recipient")
    rate = await claim_record_rate(url, 1, n // 2, 20)
    results.append(
        (
            "claim + record delivered, batches of 100, 1 connection",
            f"{rate:,.0f} recipients/s (target >= 20,000)",
        )
    )
    rate = await asyncio.to_thread(claim_record_rate_processes, url, 2, 2, n // 2, 20)
    results.append(
        (
            "claim + record delivered, batches of 100, 2 processes x 2 connections",
            f"{rate:,.0f} recipients/s (target >= 20,000)",
        )
    )
    await conn.execute("TRUNCATE message, recipient, attempt CASCADE")


async def large_table_part(
    conn: asyncpg.Connection,
    url: str,
    org_id: uuid.UUID,
    scale: float,
    results: list[tuple[str, str]],
) -> None:
    # Claim alone on an empty table vs. one with 1,000,000 finished and 100,000 not-due rows.
    due = int(100_000 * scale)
    await load_due(conn, org_id, due)
    await settle(conn)
    empty_rate = await claim_record_rate(url, 1, due, 20, record=False)
    await conn.execute("TRUNCATE message, recipient, attempt CASCADE")
    await load_due(conn, org_id, int(1_000_000 * scale), status="delivered")
    await load_due(conn, org_id, int(100_000 * scale), due_in=86400)
    await load_due(conn, org_id, due)
    await settle(conn)
    full_rate = await claim_record_rate(url, 1, due, 20, record=False)
    results.append(("claim only, batches of 100, empty table", f"{empty_rate:,.0f} recipients/s"))
    results.append(
        (
            "claim only, with 1M finished + 100k not-due rows",
            f"{full_rate:,.0f} recipients/s ({full_rate / empty_rate:.0%} of empty; target >= 90%)",
        )
    )


async def fair_part(
    conn: asyncpg.Connection,
    url: str,
    org_id: uuid.UUID,
    scale: float,
    results: list[tuple[str, str]],
) -> None:
    """The fair claim: another org's mail behind one org's 1,000,000 due recipients, and the
    claim + record rate when the due mail is spread over many (org, lane) groups."""
    backlog = int(1_000_000 * scale)
    await load_due(conn, org_id, backlog, lane="bulk")
    other = await ensure_org(conn, "bench-other")
    await load_due(conn, other, 20)
    await settle(conn)
    began = time.perf_counter()
    claimed = await claims.claim_due_recipients(
        conn, owner="bench-fair", lease=300, batch=100, lane_weights=LANE_WEIGHTS
    )
    took = time.perf_counter() - began
    theirs = sum(1 for row in claimed.rows if row.org_id == other)
    results.append(
        (
            f"fair claim: another org's 20 due behind one org's {backlog:,} due (batch 100)",
            f"{theirs} of 20 in the first claim, which took {took * 1000:.1f} ms",
        )
    )
    await conn.execute("TRUNCATE message, recipient, attempt CASCADE")
    n = int(200_000 * scale)
    orgs = [await ensure_org(conn, f"bench-{i:02d}") for i in range(20)]
    for i, org in enumerate(orgs):
        await load_due(conn, org, n // 20, lane="bulk" if i % 2 else "transactional")
    await settle(conn)
    rate = await asyncio.to_thread(claim_record_rate_processes, url, 2, 2, n // 2, 20)
    results.append(
        (
            "claim + record delivered, due mail of 20 orgs in 2 lanes, 2 processes x 2 connections",
            f"{rate:,.0f} recipients/s (target >= 20,000)",
        )
    )
    await conn.execute("TRUNCATE message, recipient, attempt CASCADE")


async def load_deferred_orgs(conn: asyncpg.Connection, orgs: int) -> None:
    """`orgs` orgs with one deferred recipient each, due in an hour, as the record leaves them
    (in the retry queue where the schema has one)."""
    await conn.execute(
        "INSERT INTO org (id, name) SELECT gen_random_uuid(), 'deferred-' || i"
        " FROM generate_series(1, $1) AS i",
        orgs,
    )
    has_site = await conn.fetchval(
        "SELECT count(*) FROM information_schema.columns"
        " WHERE table_name = 'recipient' AND column_name = 'site'"
    )
    site = ", 'later'" if has_site else ""
    await conn.execute(
        f"""
        WITH m AS (
            INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
            SELECT gen_random_uuid(), o.id, 'sender@example.com', 20, 'x', 'bench', now()
            FROM org o WHERE o.name LIKE 'deferred-%'
            RETURNING id, org_id
        )
        INSERT INTO recipient (id, message_id, org_id, address, domain, created_at,
                               next_attempt_at, attempts{", site" if has_site else ""})
        SELECT gen_random_uuid(), m.id, m.org_id, 'rcpt@deferred.example', 'deferred.example',
               now(), now() + interval '1 hour', 1{site}
        FROM m
        """
    )


async def deferred_part(
    conn: asyncpg.Connection,
    url: str,
    org_id: uuid.UUID,
    scale: float,
    results: list[tuple[str, str]],
) -> None:
    """Claim + record beside 20,000 orgs that hold deferred mail, against the same without."""
    n = int(200_000 * scale)
    await load_due(conn, org_id, n)
    await settle(conn)
    alone = await asyncio.to_thread(claim_record_rate_processes, url, 2, 2, n // 2, 20)
    await conn.execute("TRUNCATE message, recipient, attempt CASCADE")
    orgs = int(20_000 * scale)
    await load_deferred_orgs(conn, orgs)
    await load_due(conn, org_id, n)
    await settle(conn)
    beside = await asyncio.to_thread(claim_record_rate_processes, url, 2, 2, n // 2, 20)
    results.append(
        (
            "claim + record delivered, 2 processes x 2 connections, no deferred mail",
            f"{alone:,.0f} recipients/s",
        )
    )
    results.append(
        (
            f"the same beside {orgs:,} orgs holding deferred mail",
            f"{beside:,.0f} recipients/s ({beside / alone:.0%}; target >= 90%)",
        )
    )
    await conn.execute("TRUNCATE message, recipient, attempt CASCADE")
    await conn.execute("DELETE FROM org WHERE name LIKE 'deferred-%'")


if __name__ == "__main__":
    asyncio.run(main())
