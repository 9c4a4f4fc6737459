"""Delivery engine throughput and latency: queue -> `pigeon-mta serve` (engine only) -> sink.

    bench --store.enqueue--> PostgreSQL <--claim/record-- pigeon-mta serve --processes N
                                                            \\--SMTP (relayhost)--> sink process(es)

Messages are 5 KB and unsigned, and go into the queue through the store (not over SMTP), so the
figures are the engine's own. Phase 1 fills the queue, starts the engine and times the drain at
the sink (sustained msgs/s). Phase 2 offers new mail at half that rate (or --rate) and measures, per
message, the time from its enqueue commit (where the listener would answer 250) to the sink's
receipt of it. Bounded: --messages and --latency-seconds; loopback only; the database it creates is
dropped at the end.

    .venv/bin/python bench/engine_bench.py [--short] [--messages N] [--processes P] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.e2e import write_config  # noqa: E402
from pigeon_mta.model import Envelope  # noqa: E402
from pigeon_mta.store import queue  # noqa: E402
from pigeon_mta.store.migrate import migrate  # noqa: E402
from pigeon_mta.store.orgs import ensure_org  # noqa: E402

SINK_HOST = "127.0.0.2"


def body(index: int, size: int = 5120) -> bytes:
    head = (
        f"From: bench@sender.test\r\nTo: rcpt@dest.test\r\nSubject: bench {index}\r\n"
        f"Message-ID: <bench-{index}@sender.test>\r\n\r\n"
    ).encode()
    line = b"The quick brown fox jumps over the lazy dog, again and again and again.\r\n"
    text = head
    while len(text) < size:
        text += line
    return text[: size - 2] + b"\r\n"


# ---------------------------------------------------------------- sink (separate process)


def sink_main(port: int, count: Synchronized[int], results: Connection, ready: Any) -> None:
    """A bare aiosmtpd sink on SINK_HOST:port (SO_REUSEPORT, so several can share the port)."""
    from aiosmtpd.smtp import SMTP, Session

    arrivals: list[tuple[int, float]] = []

    class Handler:
        async def handle_DATA(self, server: SMTP, session: Session, envelope: Any) -> str:
            data = envelope.original_content or b""
            start = data.find(b"Message-ID: <bench-")
            if start >= 0:
                end = data.find(b"@", start)
                arrivals.append((int(data[start + 19 : end]), time.time()))
            with count.get_lock():
                count.value += 1
            return "250 2.0.0 OK"

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        server = await loop.create_server(
            lambda: SMTP(Handler(), hostname="sink.test", data_size_limit=None),
            SINK_HOST,
            port,
            reuse_port=True,
        )
        ready.set()
        await stop.wait()
        server.close()

    asyncio.run(run())
    results.send(arrivals)


# ---------------------------------------------------------------- helpers


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children so far (from /proc), in seconds."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    for p in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def postgres_cpu(admin: asyncpg.Connection, db_name: str) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL backend serving the bench database (same machine)."""
    rows = await admin.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", db_name)
    return {r["pid"]: cpu_seconds(r["pid"]) for r in rows}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_serve(config: Path, processes: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIGEON_LOG_LEVEL": "info"}
    command = [sys.executable, "-m", "pigeon_mta", "serve", "--config", str(config)]
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [*command, "--processes", str(processes)],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


async def enqueue_many(pool: asyncpg.Pool, org_id: uuid.UUID, first: int, count: int) -> None:
    async def worker(indexes: range) -> None:
        for i in indexes:
            await queue.enqueue(pool, envelope(org_id, i))

    workers = 8
    await asyncio.gather(
        *(worker(range(first + w, first + count, workers)) for w in range(workers))
    )


def envelope(org_id: uuid.UUID, index: int) -> Envelope:
    return Envelope(
        org_id=org_id,
        sender="bench@sender.test",
        recipients=(f"rcpt{index}@dest.test",),
        body=body(index),
        listener="bench",
        header_message_id=f"bench-{index}@sender.test",
    )


async def paced_enqueue(
    pool: asyncpg.Pool, org_id: uuid.UUID, first: int, rate: float, seconds: float
) -> dict[int, float]:
    """Offer messages at `rate` per second for `seconds`; returns index -> commit time."""
    committed: dict[int, float] = {}
    total = int(rate * seconds)
    start = time.monotonic()
    slots = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        async with slots:
            await queue.enqueue(pool, envelope(org_id, first + i))
            committed[first + i] = time.time()

    tasks = []
    for i in range(total):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return committed


async def timed_drain(count: Synchronized[int], target: int, timeout: float) -> float:
    """Wait for `target` arrivals; seconds from the first arrival to the last (50 ms grain)."""
    deadline = time.monotonic() + timeout
    first: float | None = None
    while count.value < target:
        if first is None and count.value > 0:
            first = time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit(f"sink received {count.value} of {target} within {timeout}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - (first or time.monotonic())


async def wait_count(count: Synchronized[int], target: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while count.value < target:
        if time.monotonic() > deadline:
            raise SystemExit(f"sink received {count.value} of {target} within {timeout}s")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- main


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    admin = await asyncpg.connect(args.database_url)
    db_name = f"pigeon_bench_{os.getpid()}"
    await admin.execute(f'CREATE DATABASE "{db_name}"')
    db_url = args.database_url.rsplit("/", 1)[0] + "/" + db_name
    workdir = Path(tempfile.mkdtemp(prefix="pigeon-engine-bench-"))
    ctx = multiprocessing.get_context("spawn")
    count: Synchronized[int] = ctx.Value("i", 0)  # type: ignore[assignment]
    port = free_port(SINK_HOST)
    sinks = []
    pipes = []
    serve: subprocess.Popen[bytes] | None = None
    try:
        conn = await asyncpg.connect(db_url)
        await migrate(conn)
        await conn.close()
        pool = await asyncpg.create_pool(db_url, min_size=2, max_size=10)
        assert pool is not None
        org_id = await ensure_org(pool, "internal")
        for _ in range(args.sink_processes):
            receiver, sender = ctx.Pipe(duplex=False)
            ready = ctx.Event()
            proc = ctx.Process(target=sink_main, args=(port, count, sender, ready), daemon=True)
            proc.start()
            if not ready.wait(30):
                raise SystemExit("sink did not start")
            sinks.append(proc)
            pipes.append(receiver)

        print(f"queueing {args.messages} messages of 5 KB ...", flush=True)
        t = time.monotonic()
        await enqueue_many(pool, org_id, 0, args.messages)
        print(f"  queued in {time.monotonic() - t:.1f}s", flush=True)

        config = workdir / "pigeon.toml"
        write_config(
            config,
            f"""listener = []
[server]
node_name = "bench"
hostname = "bench.test"
data_dir = "{workdir}"
[database]
url = "{db_url}"
pool_size = 10
[metrics]
listen = "127.0.0.1:{free_port("127.0.0.1")}"
[delivery]
relayhost = "{SINK_HOST}:{port}"
tls = "none"
relayhost_tls = "none"
concurrency = {args.concurrency}
destination_concurrency = {args.concurrency}
max_connections_per_host = {args.concurrency}
max_messages_per_connection = 1000
batch_size = {args.batch}
""",
        )
        serve = start_serve(config, args.processes, workdir / "serve.log")
        sink_cpu0 = sum(cpu_seconds(p.pid) for p in sinks if p.pid)
        engine_cpu0 = cpu_seconds(serve.pid)
        pg_cpu0 = await postgres_cpu(admin, db_name)
        drain = await timed_drain(count, args.messages, timeout=args.messages / 50 + 60)
        engine_cpu = cpu_seconds(serve.pid) - engine_cpu0
        sink_cpu = sum(cpu_seconds(p.pid) for p in sinks if p.pid) - sink_cpu0
        pg_cpu = sum(
            t - pg_cpu0.get(pid, 0.0) for pid, t in (await postgres_cpu(admin, db_name)).items()
        )

        # Phase 2 offers half the rate phase 1 drained at (the exact figure is computed from
        # the sink's arrival times at the end; this estimate only picks the offered rate).
        offered = args.rate or args.messages / max(0.001, drain) / 2
        committed: dict[int, float] = {}
        if args.latency_seconds > 0:
            print(f"phase 2: offering {offered:.0f} msgs/s for {args.latency_seconds}s ...")
            committed = await paced_enqueue(
                pool, org_id, args.messages, offered, args.latency_seconds
            )
            await wait_count(count, args.messages + len(committed), timeout=120)
        await pool.close()
    finally:
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                serve.wait(60)
            if serve.poll() is None:
                serve.kill()
        for proc in sinks:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        arrivals: dict[int, float] = {}
        for pipe in pipes:
            if pipe.poll(30):
                arrivals.update(dict(pipe.recv()))
        for proc in sinks:
            proc.join(10)
        await admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        await admin.close()

    fill = sorted(arrivals[i] for i in range(args.messages) if i in arrivals)
    # Sustained rate: the middle 80% of the drain (start-up and the tail left out).
    lo, hi = int(len(fill) * 0.1), int(len(fill) * 0.9)
    sustained = (hi - lo) / max(1e-6, fill[hi - 1] - fill[lo]) if hi - lo > 1 else 0.0
    whole = len(fill) / max(1e-6, fill[-1] - fill[0]) if len(fill) > 1 else 0.0
    latencies = [arrivals[i] - t for i, t in committed.items() if i in arrivals]
    result: dict[str, Any] = {
        "messages": args.messages,
        "processes": args.processes,
        "sustained_msgs_per_s": round(sustained, 1),
        "drain_msgs_per_s": round(whole, 1),
        "engine_cpu_s_per_1000_msgs": round(engine_cpu / args.messages * 1000, 2),
        "sink_cpu_s_per_1000_msgs": round(sink_cpu / args.messages * 1000, 2),
        "postgres_cpu_s_per_1000_msgs": round(pg_cpu / args.messages * 1000, 2),
        "drain_seconds": round(fill[-1] - fill[0], 2) if fill else None,
        "offered_rate": round(offered, 1),
        "latency_messages": len(latencies),
    }
    if latencies:
        result.update(
            latency_p50_ms=round(percentile(latencies, 0.50) * 1000, 1),
            latency_p99_ms=round(percentile(latencies, 0.99) * 1000, 1),
            latency_mean_ms=round(statistics.fmean(latencies) * 1000, 1),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="a server where the bench may create and drop a database",
    )
    parser.add_argument("--messages", type=int, default=10000, help="phase 1 queue size")
    parser.add_argument("--processes", type=int, default=2, help="engine worker processes")
    parser.add_argument("--sink-processes", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=50, help="transactions per process")
    parser.add_argument("--batch", type=int, default=100, help="delivery.batch_size")
    parser.add_argument(
        "--rate", type=float, default=None, help="phase 2 rate (default: half of phase 1)"
    )
    parser.add_argument("--latency-seconds", type=float, default=20)
    parser.add_argument("--short", action="store_true", help="a quick check: 2000 messages, 5s")
    args = parser.parse_args()
    if args.short:
        args.messages, args.latency_seconds = 2000, 5.0
    result = asyncio.run(bench(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
