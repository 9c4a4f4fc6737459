"""Noisy neighbour: how long an org's transactional mail waits while another org's backlog drains.

    loader (20 sessions) --relay listener, org acme--> pigeon-mta serve --> smtp-sink 127.0.0.2
        10,000 messages to bulk.test, paced by [delivery.destination."bulk.test"] rate
    client --submission listener, AUTH as app--> pigeon-mta serve --> aiosmtpd sink 127.0.0.3
        20 messages to idle.test, sent once the backlog is queued

Both sinks are reached by static routes (`delivery.routes`); no DKIM. With --same-site the
backlog goes to the aiosmtpd sink too, and the rate is that host's: the transactional mail goes to
the same site, under the same budget, as the backlog. The client notes when each
transactional message got its 250, the sink in this process when it arrived (one clock); reported:
p50 / p99 / max seconds between the two, how many arrived, how many expired or bounced instead, and
the backlog left when the last one arrived. With --lane the backlog is org `app`'s own, in lane
`bulk` through the header `X-Pigeon-Lane: bulk`, and the transactional mail is in its default lane;
the run stops with a message if the relay refuses the header or queues the mail in another lane.
Bounded in count and time; loopback only.

    .venv/bin/python bench/noisy_neighbour.py [--rate 200] [--backlog 10000] [--lane]
        [--same-site] [--max-age 60s] [--timeout 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import smtplib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
from aiosmtpd.controller import Controller

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.e2e import (  # noqa: E402
    free_port,
    run,
    smtp_session,
    start_serve,
    stop_serve,
    with_db,
    write_config,
)

PASSWORD = "noisy-neighbour-password"
TRANSACTIONAL = 20


class ArrivalSink:
    """Notes when each recipient's message arrives (time.monotonic, the client's clock too)."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.lock = threading.Lock()

    async def handle_DATA(self, server: object, session: object, envelope: Any) -> str:
        now = time.monotonic()
        with self.lock:
            for rcpt in envelope.rcpt_tos:
                self.arrived.setdefault(rcpt.lower(), now)
        return "250 2.0.0 Ok"


def config_text(args: argparse.Namespace, work: Path, db_url: str, ports: dict[str, int]) -> str:
    max_age = f'max_age = "{args.max_age}"\n' if args.max_age else ""
    # --same-site: both domains go to the arrival sink, and the rate is that host's (an entry
    # matched against the route's host name), one budget for both.
    bulk_route = (
        f'"bulk.test" = "127.0.0.3:{ports["idle"]}"'
        if args.same_site
        else f'"bulk.test" = "127.0.0.2:{ports["bulk"]}"'
    )
    return f"""
[server]
hostname = "bench.test"
data_dir = "{work}"
node_name = "noisy"
{f"processes = {args.processes}" if args.processes else ""}
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{ports["relay"]}"
mode = "relay"
[[listener]]
name = "submission"
address = "127.0.0.1:{ports["submission"]}"
mode = "submission"
allow_plaintext_auth = true
[relay]
trusted_networks = ["127.0.0.0/8"]
trusted_org = "{"app" if args.lane else "acme"}"
[delivery]
{max_age}[delivery.routes]
{bulk_route}
"idle.test" = "127.0.0.3:{ports["idle"]}"
[delivery.destination."{"127.0.0.3" if args.same_site else "bulk.test"}"]
rate = {args.rate}
[log]
delivery_log = "{work / "delivery.log"}"
"""


def backlog_message(n: int, lane: bool) -> bytes:
    header = "X-Pigeon-Lane: bulk\r\n" if lane else ""
    head = (
        f"From: news@{'app' if lane else 'acme'}.test\r\nTo: reader{n}@bulk.test\r\n"
        f"Subject: newsletter {n}\r\nMessage-ID: <news-{n}-{os.getpid()}@bench.test>\r\n{header}\r\n"
    )
    return head.encode() + (b"x" * 76 + b"\r\n") * 60


async def queue_backlog(port: int, count: int, lane: bool, sessions: int = 20) -> None:
    """`count` newsletter messages over the relay listener; exits on the first refusal."""
    sender = "news@app.test" if lane else "news@acme.test"

    async def session(index: int) -> None:
        writer, reply = await smtp_session(port, "loader.bench.test")
        for n in range(index, count, sessions):
            for line in (f"MAIL FROM:<{sender}>", f"RCPT TO:<reader{n}@bulk.test>", "DATA"):
                writer.write(f"{line}\r\n".encode())
                answer = await reply()
                if answer[:1] not in (b"2", b"3"):
                    raise SystemExit(f"the relay refused {line!r}: {answer.decode().strip()}")
            writer.write(backlog_message(n, lane) + b".\r\n")
            answer = await reply()
            if not answer.startswith(b"250"):
                what = "X-Pigeon-Lane: bulk" if lane else "a backlog message"
                raise SystemExit(f"the relay refused {what}: {answer.decode().strip()}")
        writer.write(b"QUIT\r\n")
        await reply()
        writer.close()

    await asyncio.gather(*(session(i) for i in range(sessions)))


async def check_lane(conn: asyncpg.Connection) -> None:
    """Stop unless every backlog recipient was queued in lane bulk."""
    try:
        rows = await conn.fetch(
            "SELECT lane, count(*) FROM recipient WHERE domain = 'bulk.test' GROUP BY lane"
        )
    except asyncpg.UndefinedColumnError:
        raise SystemExit("this relay does not store lanes: --lane cannot be measured") from None
    lanes = {row[0]: row[1] for row in rows}
    if set(lanes) != {"bulk"}:
        raise SystemExit(
            f"the relay ignored X-Pigeon-Lane: bulk: the backlog's recipients are in {lanes}"
        )


def send_transactional(port: int, spacing: float) -> dict[str, float]:
    """The 20 messages over one AUTH session, `spacing` apart; when each got its 250."""
    accepted: dict[str, float] = {}
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as client:
        client.login("app", PASSWORD)
        for n in range(TRANSACTIONAL):
            rcpt = f"reset{n}@idle.test"
            body = (
                f"From: app@app.test\r\nTo: {rcpt}\r\nSubject: password reset {n}\r\n"
                f"Message-ID: <reset-{n}-{os.getpid()}@app.test>\r\n\r\nYour code is {n}.\r\n"
            )
            client.sendmail("app@app.test", [rcpt], body)
            accepted[rcpt] = time.monotonic()
            time.sleep(spacing)
    return accepted


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def final_states(conn: asyncpg.Connection) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT status, count(*) FROM recipient WHERE domain = 'idle.test' GROUP BY status"
    )
    return {row[0]: row[1] for row in rows}


async def setup(pig: list[str], config: Path) -> None:
    run([*pig, "migrate", "--config", str(config)])
    for org in ("acme", "app"):
        run([*pig, "org", "add", org, "--config", str(config)])
        run([*pig, "domain", "add", org, f"{org}.test", "--config", str(config)])
    run(
        [*pig, "user", "add", "app", "app", "--password-stdin", "--config", str(config)],
        input=PASSWORD + "\n",
    )


async def measure(
    args: argparse.Namespace, conn: asyncpg.Connection, ports: dict[str, int], sink: ArrivalSink
) -> dict[str, object]:
    began = time.monotonic()
    await asyncio.wait_for(queue_backlog(ports["relay"], args.backlog, args.lane), args.timeout)
    queued_in = time.monotonic() - began
    if args.lane:
        await check_lane(conn)
    accepted = await asyncio.to_thread(send_transactional, ports["submission"], args.spacing)
    deadline = began + args.timeout
    while time.monotonic() < deadline:
        states = await final_states(conn)
        if sum(v for k, v in states.items() if k != "queued" and k != "delivering") >= len(
            accepted
        ):
            break
        await asyncio.sleep(0.25)
    with sink.lock:
        waits = [sink.arrived[r] - t for r, t in accepted.items() if r in sink.arrived]
    backlog_left = await conn.fetchval(
        "SELECT count(*) FROM recipient WHERE domain = 'bulk.test' AND status IN ('queued', 'delivering')"
    )
    backlog_states = {
        row[0]: row[1]
        for row in await conn.fetch(
            "SELECT status, count(*) FROM recipient WHERE domain = 'bulk.test' GROUP BY status"
        )
    }
    bulk_done = backlog_states.get("delivered", 0)
    return {
        "backlog_queued_in_s": round(queued_in, 1),
        "transactional_arrived": len(waits),
        "transactional_states": await final_states(conn),
        "wait_p50_s": round(statistics.median(waits), 2) if waits else None,
        "wait_p99_s": round(percentile(waits, 0.99), 2) if waits else None,
        "wait_max_s": round(max(waits), 2) if waits else None,
        "backlog_left_at_end": backlog_left,
        "backlog_states_at_end": backlog_states,
        "backlog_delivered_msgs_per_s": round(bulk_done / (time.monotonic() - began), 1),
        "wall_s": round(time.monotonic() - began, 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--rate", type=float, default=200, help='bulk.test\'s "rate", msgs/s')
    parser.add_argument("--backlog", type=int, default=10000)
    parser.add_argument("--lane", action="store_true", help="backlog in lane bulk of org app")
    parser.add_argument(
        "--same-site",
        action="store_true",
        help="the transactional mail goes to the backlog's site, under its rate",
    )
    parser.add_argument("--max-age", help='delivery.max_age, e.g. "60s" (default: the config\'s)')
    parser.add_argument("--processes", type=int, help="server.processes (default: the config's)")
    parser.add_argument("--spacing", type=float, default=0.25, help="seconds between resets")
    parser.add_argument("--timeout", type=float, default=300, help="give up after this")
    args = parser.parse_args()
    if shutil.which("smtp-sink") is None and not Path("/usr/sbin/smtp-sink").exists():
        sys.exit("smtp-sink is missing: apt-get install postfix")
    if args.rate <= 0 or args.backlog < 1:
        sys.exit("--rate and --backlog must be positive")

    work = Path(tempfile.mkdtemp(prefix="pigeon-noisy-"))
    name = f"pigeon_noisy_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_db(args.url, name)
    ports = {k: free_port() for k in ("relay", "submission", "bulk", "idle", "metrics")}
    config = work / "pigeon.toml"
    write_config(config, config_text(args, work, db_url, ports))
    pig = [sys.executable, "-m", "pigeon_mta"]
    sink = ArrivalSink()
    idle = Controller(sink, hostname="127.0.0.3", port=ports["idle"])
    bulk = subprocess.Popen(
        [
            shutil.which("smtp-sink") or "/usr/sbin/smtp-sink",
            "-u",
            "nobody",
            f"127.0.0.2:{ports['bulk']}",
            "1000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    serve: subprocess.Popen[str] | None = None
    results: dict[str, object] = {}
    idle.start()
    try:
        await setup(pig, config)
        processes = args.processes or os.cpu_count() or 1
        serve = await start_serve(config, work / "serve.log", processes, "submission")
        conn = await asyncpg.connect(db_url)
        try:
            results = await measure(args, conn, ports, sink)
        finally:
            await conn.close()
    finally:
        if serve is not None:
            stop_serve(serve)
        bulk.terminate()
        bulk.wait(10)
        idle.stop()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"# noisy_neighbour {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, processes={args.processes or 'default'}, "
        f"backlog {args.backlog} at rate {args.rate:g} ({'lane bulk, one org' if args.lane else 'org acme'}), "
        f"max_age {args.max_age or 'default'}{', same site' if args.same_site else ''}"
    )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    # SIGTERM (`timeout`, a supervisor) unwinds like Ctrl-C, so the cleanup in main() still runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit("interrupted: the processes, the scratch database and files are cleaned up")
