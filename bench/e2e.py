"""End to end: SMTP in -> queue -> engine (DKIM) -> SMTP out, on one machine, with real peers.

    smtp-source (20 sessions, 5 KB) --SMTP--> relay listener of `pigeon-mta serve --processes N`
        --> PostgreSQL (fresh database, fsync on) --> engine (RSA-2048 DKIM) --SMTP (relayhost)-->
        smtp-sink on loopback

With --route mx the engine finds the sink by MX lookup instead of through `delivery.relayhost`:
sink.test MX mx.sink.test, A 127.0.0.2, served by a loopback DNS server (tests/peers/dns_server.py)
in this process; the answers' TTL outlasts the run, so the workers' resolver cache answers all but
the first lookup. With --sink-dump smtp-sink appends every message to a file. With --return-path
every message leaves from a VERP address at a return-path domain (feedback/return_paths.py).

Phase 1 (capacity): smtp-source sends --messages over reused connections as fast as pigeon takes
them; reported: accept rate (messages / time until smtp-source finished), end-to-end rate (messages /
time until the last one was delivered), the queue depth seen while it ran, and CPU per component.
Phase 2 (latency): new mail offered at --half-rate (default: half the end-to-end rate of phase 1)
for --latency-seconds; reported: accept-to-delivery p50 / p99 from the database (delivery time =
attempt start + duration; accept time = the message row's received_at, the commit that preceded
the 250). Also: peak RSS per pigeon process. Bounded in count and time; loopback only.

    .venv/bin/python bench/e2e.py [--messages 20000] [--processes 2] [--dkim rsa|ed25519|none]
        [--route relayhost|mx] [--sink-dump] [--duplicate-window W] [--concurrency N]
        [--destination-concurrency N] [--max-connections-per-host N] [--return-path]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import pg_profile  # noqa: E402
from tests.peers.dns_server import DnsServer  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: Path, text: str) -> Path:
    """`text` as the serve's config at `path`. Without an [api] table it gets an API port of its
    own: the default 127.0.0.1:8025 is one port for every serve on the host, and a serve whose
    port another program holds does not start."""
    if "[api]" not in text:
        text = f'api.listen = "127.0.0.1:{free_port()}"\n' + text  # a dotted key, before tables
    path.write_text(text)
    return path


def with_db(url: str, name: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, "/" + name, p.query, ""))


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat: busy is what
    ran here, steal what the host gave to others while this VM wanted to run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / TICKS, steal / TICKS


class Cpu:
    """CPU seconds used by groups of processes between two readings, and by the whole machine.

    PostgreSQL's processes (those of the bench's server only, `pg_pids`) are listed at both ends:
    a backend that existed at the start counts from its reading then, one started during the phase
    (a new pool connection) from zero."""

    def __init__(self, groups: dict[str, list[int]], pg_pids: Callable[[], list[int]]) -> None:
        self.groups = groups
        self.pg_pids = pg_pids
        self.began = time.monotonic()
        self.start = {p: cpu_seconds(p) for pids in groups.values() for p in pids}
        self.pg_start = {p: cpu_seconds(p) for p in pg_pids()}
        self.machine_start = machine_cpu()

    def used(self) -> dict[str, float]:
        out = {
            group: sum(cpu_seconds(p) - self.start[p] for p in pids)
            for group, pids in self.groups.items()
        }
        out["postgresql"] = sum(cpu_seconds(p) - self.pg_start.get(p, 0.0) for p in self.pg_pids())
        return out

    def postgresql(self) -> dict[int, float]:
        """PostgreSQL's CPU seconds by process."""
        return {p: cpu_seconds(p) - self.pg_start.get(p, 0.0) for p in self.pg_pids()}

    def per_process(self, pids: list[int]) -> list[float]:
        return [cpu_seconds(p) - self.start[p] for p in pids]

    def machine(self) -> tuple[float, float]:
        """(busy, steal) CPU seconds of the machine since the start of the phase."""
        busy, steal = machine_cpu()
        return busy - self.machine_start[0], steal - self.machine_start[1]


def saturation(
    cpu: Cpu, wall: float, workers: list[int], used: dict[str, float]
) -> dict[str, object]:
    """What ran out: every core of the machine, one worker's core (a single event loop), or
    neither (then the offered load or the round trips set the pace, not the CPU). `used` is the
    reading the caller took at the end of the interval `wall`."""
    cores = os.cpu_count() or 1
    busy, steal = cpu.machine()
    per_worker = [round(c / wall, 2) for c in cpu.per_process(workers)]
    machine = busy / wall
    ranked = sorted(used.items(), key=lambda kv: kv[1], reverse=True)
    top = ", ".join(f"{k} {v / wall:.2f}" for k, v in ranked if v / wall >= 0.05)
    stolen = f", {steal / wall:.2f} taken by the host" if steal / wall >= 0.05 else ""
    if (busy + steal) / wall >= 0.9 * cores:
        verdict = f"CPU: {machine:.2f} of {cores} cores busy{stolen} ({top} cores)"
    elif per_worker and max(per_worker) >= 0.9:
        verdict = f"one worker process's core ({max(per_worker):.2f}): its event loop"
    else:
        verdict = (
            f"not the CPU ({machine:.2f} of {cores} cores busy): the offered load or round trips"
        )
    return {
        "machine_cores_busy": round(machine, 2),
        "machine_steal_cores": round(steal / wall, 2),
        "worker_cores_busy": per_worker,
        "saturated": verdict,
    }


async def transactions(conn: asyncpg.Connection) -> int:
    """Transactions committed or rolled back in this database so far (the statistics collector's
    count, flushed at most once a second: read it after a pause)."""
    await asyncio.sleep(1.1)
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(
        await conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        )
    )


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Run from the checkout: `python -m` puts the working directory first on sys.path, so the
    # code measured is this checkout's, whatever directory the bench was started from.
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, check=True, timeout=120, cwd=REPO, **kwargs
    )  # type: ignore[call-overload,no-any-return]


def message_bytes(size: int, n: int) -> bytes:
    head = (
        f"From: sender@bench.test\r\nTo: rcpt@sink.test\r\nSubject: e2e {n}\r\n"
        f"Message-ID: <e2e-{n}-{os.getpid()}@bench.test>\r\n\r\n"
    ).encode()
    line = b"x" * 76 + b"\r\n"
    return head + line * max(1, (size - len(head)) // len(line))


async def smtp_session(
    port: int, helo: str
) -> tuple[asyncio.StreamWriter, Callable[[], Awaitable[bytes]]]:
    """A plain SMTP session to 127.0.0.1:port, greeted and EHLO'd; `reply()` reads one reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def reply() -> bytes:
        while True:
            line = await reader.readline()
            if line[3:4] != b"-":
                return line

    await reply()
    writer.write(f"EHLO {helo}\r\n".encode())
    await reply()
    return writer, reply


async def paced_load(port: int, rate: float, count: int, sessions: int, size: int) -> None:
    """`count` messages at `rate` msgs/s over `sessions` reused connections (plain SMTP)."""
    interval = sessions / rate
    start = time.monotonic()

    async def session(index: int) -> None:
        writer, reply = await smtp_session(port, "loader.bench.test")
        n = index
        due = start + index * interval / sessions
        while n < count:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            writer.write(b"MAIL FROM:<sender@bench.test>\r\n")
            await reply()
            writer.write(b"RCPT TO:<rcpt@sink.test>\r\n")
            await reply()
            writer.write(b"DATA\r\n")
            await reply()
            writer.write(message_bytes(size, n) + b".\r\n")
            await reply()
            n += sessions
            due += interval
        writer.write(b"QUIT\r\n")
        await reply()
        writer.close()

    await asyncio.gather(*(session(i) for i in range(sessions)))


async def start_serve(
    config: Path, log: Path, processes: int, listener: str = "relay", ready: str = ""
) -> subprocess.Popen[str]:
    """`pigeon-mta serve`, once every worker has bound `listener` (or logged `ready`)."""
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pigeon_mta", "serve", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            text=True,
        )
    deadline = time.monotonic() + 60
    ready = ready or f"listener {listener} bound"
    while log.read_text().count(ready) < processes:
        if time.monotonic() > deadline or serve.poll() is not None:
            stop_serve(serve)
            raise SystemExit("serve did not start:\n" + log.read_text())
        await asyncio.sleep(0.2)
    return serve


def stop_serve(serve: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """SIGTERM (serve drains and exits), then SIGKILL if it has not exited within a minute."""
    serve.send_signal(signal.SIGTERM)
    try:
        serve.wait(60)
    except subprocess.TimeoutExpired:
        serve.kill()
        serve.wait(10)


async def delivered(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivered'"))


async def reuse_counts(metrics_port: int) -> dict[str, float]:
    """Outbound connections reused and open, from pigeon's /metrics (all workers together)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", metrics_port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    text = (await reader.read()).decode()
    writer.close()
    wanted = ("pigeon_outbound_connection_reuses_total", "pigeon_outbound_connections_open")
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def limits_config(args: argparse.Namespace) -> str:
    if args.duplicate_window is None:
        return ""
    return f'[limits]\nduplicate_window = "{args.duplicate_window}"\n'


def delivery_tuning(args: argparse.Namespace) -> str:
    """The [delivery] limits given on the command line (the rest keep the config's defaults)."""
    keys = ("concurrency", "destination_concurrency", "max_connections_per_host")
    return "".join(f"{k} = {getattr(args, k)}\n" for k in keys if getattr(args, k) is not None)


def route_config(route: str, sink_port: int, dns: DnsServer | None, tuning: str = "") -> str:
    """The [delivery] and [dns] config that sends the bench's mail to the sink."""
    if route == "relayhost" or dns is None:
        return f'[delivery]\n{tuning}relayhost = "127.0.0.2:{sink_port}"\nrelayhost_tls = "none"\n'
    # A TTL longer than any run: the MX path pays for the cache lookups, not for DNS queries.
    dns.mx("sink.test", (10, "mx.sink.test"), ttl=3600)
    dns.a("mx.sink.test", "127.0.0.2", ttl=3600)
    return f'[delivery]\n{tuning}port = {sink_port}\ntls = "none"\n[dns]\nnameservers = ["{dns.nameserver}"]\n'


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=5120)
    parser.add_argument("--dkim", choices=["rsa", "ed25519", "none"], default="rsa")
    parser.add_argument("--half-rate", type=float, default=0.0, help="phase 2 offered msgs/s")
    parser.add_argument("--latency-seconds", type=float, default=30)
    parser.add_argument("--delivery-log", choices=["file", "off"], default="file")
    parser.add_argument("--timeout", type=float, default=300, help="phase 1 gives up after this")
    parser.add_argument("--route", choices=["relayhost", "mx"], default="relayhost")
    parser.add_argument("--sink-dump", action="store_true", help="smtp-sink writes every message")
    parser.add_argument(
        "--duplicate-window",
        help="limits.duplicate_window (default: the config's own); smtp-source sends a Message-ID, "
        "so every message takes the duplicate check unless this is 0",
    )
    parser.add_argument(
        "--statements",
        type=int,
        default=0,
        help="report phase 1's N costliest statements per message (the server must load "
        "pg_stat_statements), WAL and rows written per table",
    )
    parser.add_argument(
        "--return-path",
        action="store_true",
        help="[bounces] return_path_domain set: every message leaves from its own VERP address",
    )
    parser.add_argument("--concurrency", type=int, help="delivery.concurrency")
    parser.add_argument("--destination-concurrency", dest="destination_concurrency", type=int)
    parser.add_argument("--max-connections-per-host", dest="max_connections_per_host", type=int)
    args = parser.parse_args()
    for tool in ("smtp-source", "smtp-sink"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"{tool} is missing: apt-get install postfix")
    source = shutil.which("smtp-source") or "/usr/sbin/smtp-source"
    sink_cmd = shutil.which("smtp-sink") or "/usr/sbin/smtp-sink"

    work = Path(tempfile.mkdtemp(prefix="pigeon-e2e-"))
    name = f"pigeon_e2e_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_db(args.url, name)
    relay_port, sink_port, metrics_port = free_port(), free_port(), free_port()
    dns = await DnsServer().start() if args.route == "mx" else None
    config = work / "pigeon.toml"
    bounces = '[bounces]\nreturn_path_domain = "bounces.bench.test"\n' if args.return_path else ""
    write_config(
        config,
        f"""
[server]
hostname = "bench.test"
data_dir = "{work}"
node_name = "bench"
processes = {args.processes}
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{relay_port}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.0/8"]
{route_config(args.route, sink_port, dns, delivery_tuning(args))}{limits_config(args)}{bounces}[metrics]
listen = "127.0.0.1:{metrics_port}"
[log]
delivery_log = "{work / "delivery.log" if args.delivery_log == "file" else ""}"
""",
    )
    py = sys.executable
    pig = [py, "-m", "pigeon_mta"]
    run([*pig, "migrate", "--config", str(config)])
    run([*pig, "org", "add", "internal", "--config", str(config)])
    run([*pig, "domain", "add", "internal", "bench.test", "--config", str(config)])
    if args.dkim != "none":
        run(
            [
                *pig,
                "dkim",
                "keygen",
                "bench.test",
                "--selector",
                "b1",
                "--algorithm",
                args.dkim,
                "--config",
                str(config),
            ]
        )

    dump: list[str] = []
    if args.sink_dump:
        # smtp-sink runs as nobody: its directory must be reachable and writable by it.
        work.chmod(0o711)
        (work / "sink").mkdir()
        (work / "sink").chmod(0o777)
        dump = ["-D", str(work / "sink" / "dump")]
    sink = subprocess.Popen(
        [sink_cmd, "-u", "nobody", *dump, "127.0.0.2:" + str(sink_port), "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    serve_log = open(work / "serve.log", "w")
    serve = subprocess.Popen(
        [*pig, "serve", "--config", str(config)],
        stdout=serve_log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    results: dict[str, object] = {}
    conn = await asyncpg.connect(db_url)
    fsync = await conn.fetchval("SHOW fsync")
    sync_commit = await conn.fetchval("SHOW synchronous_commit")
    pg_pids = await pg_profile.server_processes(conn)
    # The backend of this bench's own connection: its polling is not pigeon-mta's cost.
    bench_backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
    statements = args.statements > 0 and await pg_profile.statements_available(conn)
    try:
        deadline = time.monotonic() + 60
        while (work / "serve.log").read_text().count("listener relay bound") < args.processes:
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit("serve did not start:\n" + (work / "serve.log").read_text())
            await asyncio.sleep(0.2)
        workers = [
            p
            for p in children(serve.pid)
            if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        # ---------------- phase 1: capacity
        xacts = await transactions(conn)
        if statements:
            await pg_profile.reset(conn)
        cpu = Cpu(
            {
                "pigeon supervisor": [serve.pid],
                "pigeon workers": workers,
                "smtp-sink": [sink.pid],
            },
            pg_pids,
        )
        began = time.monotonic()
        load = subprocess.Popen(
            [
                source,
                "-d",
                "-s",
                str(args.sessions),
                "-l",
                str(args.size),
                "-m",
                str(args.messages),
                "-f",
                "sender@bench.test",
                "-t",
                "rcpt@sink.test",
                f"127.0.0.1:{relay_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        max_depth = 0
        accepted_at = None
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if accepted_at is None and load.poll() is not None:
                accepted_at = now
            depth = int(
                await conn.fetchval(
                    "SELECT count(*) FROM recipient WHERE status IN ('queued','delivering')"
                )
            )
            max_depth = max(max_depth, depth)
            done = await delivered(conn)
            if accepted_at is not None and done >= args.messages:
                break
            if now - began > args.timeout:
                print(f"phase 1 timed out: {done} of {args.messages} delivered", file=sys.stderr)
                break
        finished = time.monotonic()
        used = cpu.used()
        pg_used = cpu.postgresql()
        wall = finished - began
        accepted = int(await conn.fetchval("SELECT count(*) FROM message"))
        e2e_done = await delivered(conn)
        reuses = await reuse_counts(metrics_port)
        results["phase1"] = {
            "messages_offered": args.messages,
            "accepted": accepted,
            "delivered": e2e_done,
            "accept_rate": round(accepted / ((accepted_at or finished) - began), 1),
            "e2e_rate": round(e2e_done / wall, 1),
            "max_queue_depth": max_depth,
            "wall_s": round(wall, 1),
            "cpu_s": {k: round(v, 1) for k, v in used.items()},
            "cores_busy": {k: round(v / wall, 2) for k, v in used.items()},
            # pigeon-mta's: every process of the server but the bench's own polling backend.
            "postgresql_cpu_ms_per_message": round(
                (used["postgresql"] - pg_used.get(bench_backend, 0.0)) * 1000 / max(1, e2e_done), 3
            ),
            "bench_polling_postgresql_cpu_ms_per_message": round(
                pg_used.get(bench_backend, 0.0) * 1000 / max(1, e2e_done), 3
            ),
            # Every transaction of the run (the bench's own polling included: 2 per 0.25 s).
            "db_transactions_per_message": round(
                (await transactions(conn) - xacts) / max(1, e2e_done), 2
            ),
            **saturation(cpu, wall, workers, used),
            "connection_reuses": reuses.get("pigeon_outbound_connection_reuses_total", 0),
            "connections_open": reuses.get("pigeon_outbound_connections_open", 0),
            "load_stderr": (load.stderr.read().decode()[-300:] if load.stderr else ""),
        }
        if statements:
            results["phase1_postgresql"] = {
                "cpu_ms_per_msg": await pg_profile.cpu_by_role(conn, pg_used, e2e_done),
                **await pg_profile.report(conn, e2e_done, args.statements),
            }
        # ---------------- phase 2: latency at half rate
        rate = args.half_rate or max(10.0, results["phase1"]["e2e_rate"] / 2)  # type: ignore[index]
        count = int(rate * args.latency_seconds)
        mark = await conn.fetchval("SELECT now()")
        xacts = await transactions(conn)
        began = time.monotonic()
        cpu = Cpu(
            {
                "pigeon supervisor": [serve.pid],
                "pigeon workers": workers,
                "smtp-sink": [sink.pid],
            },
            pg_pids,
        )
        load_cpu_before = time.process_time()
        await paced_load(relay_port, rate, count, args.sessions, args.size)
        results["loader_cpu_s"] = round(time.process_time() - load_cpu_before, 1)
        offered_for = time.monotonic() - began
        target = e2e_done + int(
            await conn.fetchval("SELECT count(*) FROM message WHERE received_at >= $1", mark)
        )
        deadline = time.monotonic() + 60
        while await delivered(conn) < target and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        used = cpu.used()
        measured = time.monotonic() - began  # the offered load and the drain after it
        row = await conn.fetchrow(
            """SELECT count(*) AS n,
                      percentile_cont(0.5) WITHIN GROUP (ORDER BY lat) * 1000 AS p50,
                      percentile_cont(0.99) WITHIN GROUP (ORDER BY lat) * 1000 AS p99,
                      max(lat) * 1000 AS max
               FROM (SELECT extract(epoch FROM a.started_at + a.duration_ms * interval '1 ms' - m.received_at) AS lat
                     FROM attempt a JOIN message m ON m.id = a.message_id
                     WHERE a.outcome = 'delivered' AND m.received_at >= $1) t""",
            mark,
        )
        results["phase2"] = {
            "offered_rate": round(row["n"] / offered_for, 1) if row["n"] else 0,
            "target_rate": round(rate, 1),
            "messages": row["n"],
            "p50_ms": round(row["p50"] or 0, 1),
            "p99_ms": round(row["p99"] or 0, 1),
            "max_ms": round(row["max"] or 0, 1),
            "cores_busy": {k: round(v / measured, 2) for k, v in used.items()},
            "db_transactions_per_message": round(
                (await transactions(conn) - xacts) / max(1, row["n"]), 2
            ),
            **saturation(cpu, measured, workers, used),
        }
        results["peak_rss_mb"] = {
            f"pid {p}": round(peak_rss_mb(p), 1) for p in [serve.pid, *workers]
        }
        results["dkim_signed"] = (
            int(await conn.fetchval("SELECT count(*) FROM message")) and args.dkim
        )
    finally:
        await conn.close()
        stop_serve(serve)
        sink.terminate()
        sink.wait(10)
        serve_log.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        if dns is not None:
            await dns.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"# e2e {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.node()}, {os.cpu_count()} cores, "
        f"processes={args.processes}, dkim={args.dkim}, route={args.route}, "
        f"sink_dump={args.sink_dump}, load {os.getloadavg()[0]:.1f}, {args.size} B messages, {args.sessions} sessions, "
        f"fsync={fsync}, synchronous_commit={sync_commit}"
    )
    print(json.dumps(results, indent=2, default=float))
    for phase in ("phase1", "phase2"):
        if isinstance(results.get(phase), dict):
            print(f"{phase} saturated: {results[phase]['saturated']}")


if __name__ == "__main__":
    asyncio.run(main())
