"""Accept rate into the queue: messages committed per second by the real `pigeon-mta serve`.

    python bench/accept_bench.py [--seconds 10] [--runs 3] [--sessions 20] [--size 5120]
                                 [--processes 2] [--modes reused,new] [--client auto]

load (postfix smtp-source, or an asyncio client) ──SMTP, 20 sessions──► relay listener of
`pigeon-mta serve --processes N` (trusted client, no AUTH) ──► PostgreSQL (a fresh database)

Two modes: "reused" sends every message of a session over one connection (smtp-source -d); "new"
opens a connection per message. A message counts when its row is committed (the 250 is sent
after the commit). The rate of a run is the rows committed during the run divided by its wall
time; the queue is emptied between runs. Reports each run and the median, and PostgreSQL's fsync
and synchronous_commit settings.

The database server is $PIGEON_BENCH_ADMIN_URL (default: the local PostgreSQL as postgres); a
database is created for the run and dropped afterwards. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.e2e import write_config  # noqa: E402

OUT = REPO / "bench" / "out"
ADMIN_URL = os.environ.get(
    "PIGEON_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SENDER = "bench@host.internal"
RECIPIENT = "sink@example.net"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_database(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


# ---------------------------------------------------------------- the server


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(db_url: str, processes: int, workdir: Path) -> Server:
    port = free_port()
    config = workdir / "pigeon.toml"
    write_config(
        config,
        f"""
[server]
hostname = "bench.test"
data_dir = "{workdir}"
node_name = "bench"
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{port}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.1/32"]
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
enabled = false  # accept rate alone (bench/e2e.py measures accept + delivery)
[log]
delivery_log = ""
""",
    )
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "accept-serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIGEON_LOG_LEVEL": "info"}
    with open(log, "wb") as handle:
        proc = subprocess.Popen(
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
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    server = Server(proc, port, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}; see {log}")
        if log.read_text(errors="replace").count("listener relay bound on") >= processes:
            return server
        time.sleep(0.1)
    server.stop()
    raise SystemExit(f"serve did not bind in 60s; see {log}")


def cpu_seconds(pids: list[int], *, children: bool = False) -> float:
    """User + system CPU time of `pids` (and of their running children) from /proc."""
    total = 0.0
    every = list(pids)
    for pid in pids if children else []:
        try:
            every += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            pass
    for pid in every:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def client_cpu_seconds() -> float:
    """CPU of this process (the asyncio client) and of finished children (smtp-source)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime


# ---------------------------------------------------------------- load: asyncio client


def make_message(size: int) -> bytes:
    line = b"x" * 76 + b"\r\n"
    body = line * (size // len(line)) + b"y" * (size % len(line) or 1) + b"\r\n"
    head = f"From: <{SENDER}>\r\nTo: <{RECIPIENT}>\r\nSubject: bench\r\n\r\n".encode()
    return head + body


async def _reply(reader: asyncio.StreamReader) -> bytes:
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("server closed the connection")
        if line[3:4] != b"-":
            return line


async def _transaction(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> bool:
    for command, expect in (
        (f"MAIL FROM:<{SENDER}>\r\n".encode(), b"250"),
        (f"RCPT TO:<{RECIPIENT}>\r\n".encode(), b"250"),
        (b"DATA\r\n", b"354"),
    ):
        writer.write(command)
        if not (await _reply(reader)).startswith(expect):
            return False
    writer.write(payload + b".\r\n")
    return (await _reply(reader)).startswith(b"250")


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await _reply(reader)
    writer.write(b"EHLO bench.test\r\n")
    await _reply(reader)
    return reader, writer


async def _session(port: int, payload: bytes, deadline: float, reuse: bool) -> tuple[int, int]:
    ok = failed = 0
    loop = asyncio.get_running_loop()
    reader, writer = await _connect(port)
    try:
        while loop.time() < deadline:
            if await _transaction(reader, writer, payload):
                ok += 1
            else:
                failed += 1
                writer.write(b"RSET\r\n")
                await _reply(reader)
            if not reuse:
                writer.write(b"QUIT\r\n")
                await _reply(reader)
                writer.close()
                reader, writer = await _connect(port)
    finally:
        writer.close()
    return ok, failed


async def asyncio_load(port: int, sessions: int, size: int, seconds: float, reuse: bool) -> int:
    payload = make_message(size)
    deadline = asyncio.get_running_loop().time() + seconds
    results = await asyncio.gather(
        *(_session(port, payload, deadline, reuse) for _ in range(sessions))
    )
    failed = sum(f for _, f in results)
    if failed:
        print(f"    ({failed} messages refused)")
    return sum(ok for ok, _ in results)


# ---------------------------------------------------------------- load: smtp-source


def smtp_source_load(
    port: int, sessions: int, size: int, messages: int, reuse: bool, timeout: float
) -> None:
    command = ["smtp-source", "-s", str(sessions), "-l", str(size), "-m", str(messages)]
    command += ["-f", SENDER, "-t", RECIPIENT, "-M", "bench.test"]
    if reuse:
        command.append("-d")
    command.append(f"127.0.0.1:{port}")
    try:
        subprocess.run(command, check=True, timeout=timeout, capture_output=True)
    except subprocess.TimeoutExpired:
        print(f"    (smtp-source stopped after {timeout:.0f}s)")


# ---------------------------------------------------------------- runs


async def committed(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM message"))


@dataclass
class Run:
    rate: float  # messages committed per second
    serve_ms: float  # CPU time of the serve processes per message
    postgres_ms: float  # CPU time of the database's backends (this database only) per message
    client_ms: float  # CPU time of the load generator per message

    def ceiling(self, cpus: int) -> float:
        """The rate all CPUs could sustain at these costs if nothing else ran (an estimate)."""
        return 1000 * cpus / (self.serve_ms + self.postgres_ms + self.client_ms)


async def backend_pids(db: asyncpg.Connection) -> list[int]:
    rows = await db.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid()"
    )
    return [r["pid"] for r in rows]


async def one_run(
    args: argparse.Namespace,
    client: str,
    server: Server,
    db: asyncpg.Connection,
    reuse: bool,
    estimate: float,
) -> Run:
    await db.execute("TRUNCATE message CASCADE")
    await db.execute("CHECKPOINT")
    before = await committed(db)
    backends = await backend_pids(db)
    serve_before = cpu_seconds([server.proc.pid], children=True)
    postgres_before = cpu_seconds(backends)
    client_before = client_cpu_seconds()
    started = time.monotonic()
    if client == "smtp-source":
        # smtp-source sends a count, not a duration: size the count from the last rate seen.
        count = max(args.sessions * 20, int(estimate * args.seconds))
        await asyncio.to_thread(
            smtp_source_load,
            server.port,
            args.sessions,
            args.size,
            count,
            reuse,
            args.seconds * 4 + 30,
        )
    else:
        await asyncio_load(server.port, args.sessions, args.size, args.seconds, reuse)
    elapsed = time.monotonic() - started
    serve = cpu_seconds([server.proc.pid], children=True) - serve_before
    postgres = cpu_seconds(backends) - postgres_before
    client_cpu = client_cpu_seconds() - client_before
    count = max(await committed(db) - before, 1)
    return Run(
        count / elapsed, 1000 * serve / count, 1000 * postgres / count, 1000 * client_cpu / count
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10, help="length of one run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=5120, help="message body bytes")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--modes", default="reused,new")
    parser.add_argument("--client", choices=["auto", "smtp-source", "asyncio"], default="auto")
    args = parser.parse_args()
    client = args.client
    cpus = os.cpu_count() or 1
    if client == "auto":
        client = "smtp-source" if shutil.which("smtp-source") else "asyncio"

    name = f"pigeon_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(ADMIN_URL)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_database(ADMIN_URL, name)
    workdir = Path(tempfile.mkdtemp(prefix="pigeon-accept-bench-"))
    server = None
    try:
        fsync = await admin.fetchval("SHOW fsync")
        sync_commit = await admin.fetchval("SHOW synchronous_commit")
        print(
            f"client={client} sessions={args.sessions} size={args.size} processes={args.processes}"
            f" seconds={args.seconds} runs={args.runs} fsync={fsync}"
            f" synchronous_commit={sync_commit} cpus={os.cpu_count()}"
        )
        server = start_server(db_url, args.processes, workdir)
        db = await asyncpg.connect(db_url)
        try:
            # Warm-up (and the first estimate for smtp-source's message count).
            warm = await one_run(
                argparse.Namespace(**{**vars(args), "seconds": 2}),
                "asyncio",
                server,
                db,
                True,
                0,
            )
            estimate = warm.rate
            for mode in args.modes.split(","):
                reuse = mode == "reused"
                runs = []
                for i in range(args.runs):
                    run = await one_run(args, client, server, db, reuse, estimate)
                    estimate = run.rate
                    runs.append(run)
                    print(
                        f"  {mode:7} run {i + 1}: {run.rate:6.0f} msgs/s   CPU ms/msg: serve"
                        f" {run.serve_ms:.2f}, postgres {run.postgres_ms:.2f}, client"
                        f" {run.client_ms:.2f}  -> ceiling on {cpus} CPUs if alone:"
                        f" {run.ceiling(cpus):.0f} msgs/s"
                    )
                print(
                    f"  {mode:7} median: {statistics.median(r.rate for r in runs):6.0f} msgs/s"
                    f"   (ceiling {statistics.median(r.ceiling(cpus) for r in runs):.0f} msgs/s)"
                )
        finally:
            await db.close()
    finally:
        if server is not None:
            server.stop()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
