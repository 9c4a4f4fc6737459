"""The HTTP API and webhooks under load, on one machine, with real peers.

    20 keep-alive HTTP clients (this process, 5 KB) --POST /v1/messages--> `pigeon-mta serve`
        --> PostgreSQL (fresh database, fsync on) --> engine (DKIM) --SMTP (relayhost)--> smtp-sink
    webhook sender of every worker --signed POST--> receiver (aiohttp, its own process, 200 at once)

--part send (default): the clients send --messages through the API, JSON (`--via json`) or raw
RFC 5322 (`--via raw`), or smtp-source sends them over SMTP (`--via smtp`, as bench/e2e.py does,
for the webhook pairs), or 4 application connections write them to an outbox table in a scratch
application database, 100 rows per transaction, which serve relays (`--via outbox`); reported: accepted msgs/s (202s / time until the last answer), request
latency p50 / p99, the end-to-end rate (until the last delivery), CPU per component, and with
--webhook the events the receiver got, their rate, the outbox backlog and how long after the last
delivery the outbox was empty.

--part drain: how fast the webhook senders empty a full outbox. smtp-source queues --messages
(no DKIM), delivered while the webhook points at a port that refuses connections and a failed
request is retried a day later, so that every event stays in the outbox; the webhook is then
pointed at the receiver, `serve` restarted with the defaults, and the bench times the receiver's
events and samples the backlog until the outbox is empty.

Bounded in count and time; loopback only; every process it starts is stopped by its PID.

    .venv/bin/python bench/api_bench.py [--via json|raw|smtp|outbox] [--messages 20000] [--dkim rsa|none]
        [--webhook none|delivered|all] [--no-delivery] [--sender-policy P] [--part send|drain]
        [--concurrency-per-endpoint N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import asyncpg
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import pg_profile  # noqa: E402
from bench.e2e import (  # noqa: E402
    Cpu,
    children,
    delivered,
    free_port,
    message_bytes,
    peak_rss_mb,
    run,
    saturation,
    start_serve,
    stop_serve,
    transactions,
    with_db,
)
from pigeon_mta.outbox.table import ddl as outbox_ddl  # noqa: E402

SENDER = "sender@bench.test"
RECIPIENT = "rcpt@sink.test"


# ---------------------------------------------------------------- the webhook receiver


def receiver_main(port: int) -> None:
    """A webhook endpoint that answers 200 at once and counts what it got (GET /count)."""
    seen: set[str] = set()
    state = {"events": 0, "first": 0.0, "last": 0.0}

    async def event(request: web.Request) -> web.Response:
        await request.read()
        now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        if not state["events"]:
            state["first"] = now
        state["events"] += 1
        state["last"] = now
        seen.add(request.headers.get("webhook-id", ""))
        return web.Response(status=200)

    async def count(_request: web.Request) -> web.Response:
        return web.json_response({**state, "unique": len(seen)})

    app = web.Application()
    app.router.add_post("/hook", event)
    app.router.add_get("/count", count)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def start_receiver(port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--receiver", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 20
    while True:
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(
                    "the webhook receiver did not start:\n" + log.read_text()
                ) from None
            await asyncio.sleep(0.1)


async def received(http: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    async with http.get(f"http://127.0.0.1:{port}/count") as reply:
        return dict(await reply.json())


# ---------------------------------------------------------------- the API clients


def json_body(size: int, n: int) -> bytes:
    line = "x" * 76 + "\n"
    text = line * max(1, (size - 200) // len(line))
    doc = {"from": SENDER, "to": [RECIPIENT], "subject": f"api {n}", "text": text}
    return json.dumps(doc).encode()


def api_requests(via: str, count: int, size: int, key: str) -> Iterator[bytes]:
    """The HTTP/1.1 requests, built as they are sent (keep-alive: no Connection header)."""
    if via == "json":
        path, kind = "/v1/messages", "application/json"
    else:
        path = f"/v1/messages?from={quote(SENDER)}&to={quote(RECIPIENT)}"
        kind = "message/rfc822"
    for n in range(count):
        body = json_body(size, n) if via == "json" else message_bytes(size, n)
        yield (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body


async def api_client(
    port: int, requests: Iterator[bytes], latencies: list[float], statuses: Counter[int]
) -> None:
    """One keep-alive connection sending requests from the shared iterator until it ends."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for request in requests:
        began = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        latencies.append(time.perf_counter() - began)
        statuses[int(head[9:12])] += 1
    writer.close()


async def ended(work: Awaitable[Any]) -> float:
    """When `work` finished (the load's end, to the millisecond rather than the poll's 0.25 s)."""
    await work
    return time.monotonic()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# ---------------------------------------------------------------- setup


class Bench:
    """A scratch database and directory, its config, and the peers (sink, receiver)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="pigeon-api-bench-"))
        self.name = f"pigeon_api_bench_{os.getpid()}"
        self.db_url = with_db(args.url, self.name)
        self.app_url = with_db(args.url, self.name + "_app")  # --via outbox
        self.relay_port, self.sink_port, self.metrics_port = free_port(), free_port(), free_port()
        self.api_port, self.receiver_port = free_port(), free_port()
        self.config = self.work / "pigeon.toml"
        self.procs: list[subprocess.Popen[bytes]] = []

    def write_config(self, *, deliver: bool = True, webhooks_extra: str = "") -> None:
        a = self.args
        webhooks = "[webhooks]\n" + webhooks_extra
        if a.concurrency_per_endpoint:
            webhooks += f"concurrency_per_endpoint = {a.concurrency_per_endpoint}\n"
        self.config.write_text(
            f"""
[server]
hostname = "bench.test"
data_dir = "{self.work}"
node_name = "bench"
processes = {a.processes}
[database]
url = "{self.db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{self.relay_port}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.0/8"]
{f'sender_policy = "{a.sender_policy}"' if a.sender_policy else ""}
[delivery]
enabled = {"true" if deliver else "false"}
relayhost = "127.0.0.2:{self.sink_port}"
relayhost_tls = "none"
[api]
listen = "127.0.0.1:{self.api_port}"
[metrics]
listen = "127.0.0.1:{self.metrics_port}"
[log]
delivery_log = "{self.work / "delivery.log"}"
{webhooks}{self._outbox()}"""
        )

    def _outbox(self) -> str:
        if self.args.via != "outbox":
            return ""
        return (
            f'[[outbox]]\nname = "bench"\ndatabase = "{self.app_url}"\norg = "internal"\n'
            "batch = 200\n"
        )

    async def outbox_writers(self, count: int, writers: int = 4, per_tx: int = 100) -> None:
        """The application: `writers` connections commit `count` rows, `per_tx` a transaction."""
        rows = iter(range(count))

        async def writer() -> None:
            conn = await asyncpg.connect(self.app_url)
            try:
                while batch := list(itertools.islice(rows, per_tx)):
                    await conn.executemany(
                        "INSERT INTO pigeon_outbox (idempotency_key, message) VALUES ($1, $2)",
                        [(f"k{n}", json_body(self.args.size, n).decode()) for n in batch],
                    )
            finally:
                await conn.close()

        await asyncio.gather(*(writer() for _ in range(writers)))

    @property
    def receiver_url(self) -> str:
        return f"http://127.0.0.1:{self.receiver_port}/hook"

    def pigeon(self, *argv: str) -> str:
        return run([sys.executable, "-m", "pigeon_mta", *argv, "--config", str(self.config)]).stdout

    async def setup(self, dkim: str, webhook: str) -> tuple[str, str]:
        """The database, org, domain, DKIM key, API key and webhook; (API key, webhook id)."""
        admin = await asyncpg.connect(self.args.url)
        await admin.execute(f'CREATE DATABASE "{self.name}"')
        if self.args.via == "outbox":
            await admin.execute(f'CREATE DATABASE "{self.name}_app"')
            app = await asyncpg.connect(self.app_url)
            await app.execute(outbox_ddl("pigeon_outbox"))
            await app.close()
        await admin.close()
        self.write_config()
        self.pigeon("migrate")
        self.pigeon("org", "add", "internal")
        self.pigeon("domain", "add", "internal", "bench.test")
        if dkim != "none":
            self.pigeon("dkim", "keygen", "bench.test", "--selector", "b1", "--algorithm", dkim)
        key = json.loads(self.pigeon("apikey", "add", "internal", "--name", "bench", "--json"))
        hook_id = ""
        if webhook != "none":
            events = [] if webhook == "all" else ["--events", webhook]
            added = self.pigeon("webhook", "add", "internal", self.receiver_url, *events, "--json")
            hook_id = json.loads(added)["id"]
        return str(key["key"]), hook_id

    def start_sink(self) -> subprocess.Popen[bytes]:
        sink_cmd = shutil.which("smtp-sink") or "/usr/sbin/smtp-sink"
        sink = subprocess.Popen(
            [sink_cmd, "-u", "nobody", f"127.0.0.2:{self.sink_port}", "1000"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(sink)
        return sink

    def smtp_source(self, count: int) -> subprocess.Popen[bytes]:
        source = shutil.which("smtp-source") or "/usr/sbin/smtp-source"
        a = self.args
        return subprocess.Popen(
            [
                source,
                *("-d", "-s", str(a.clients), "-l", str(a.size), "-m", str(count)),
                *("-f", SENDER, "-t", RECIPIENT, f"127.0.0.1:{self.relay_port}"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def teardown(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        admin = await asyncpg.connect(self.args.url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        await admin.execute(f'DROP DATABASE IF EXISTS "{self.name}_app" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(self.work, ignore_errors=True)


def workers_of(serve: subprocess.Popen[str]) -> list[int]:
    return [
        p
        for p in children(serve.pid)
        if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
    ]


async def serve_started(bench: Bench, log: Path) -> subprocess.Popen[str]:
    serve = await start_serve(bench.config, log, bench.args.processes)
    deadline = time.monotonic() + 30
    while log.read_text().count("HTTP API on") < bench.args.processes:
        if time.monotonic() > deadline:
            stop_serve(serve)
            raise SystemExit("the HTTP API did not start:\n" + log.read_text())
        await asyncio.sleep(0.1)
    return serve


async def pending_events(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM webhook_event WHERE state = 'pending'"))


# ---------------------------------------------------------------- --part send


async def part_send(bench: Bench, key: str, http: aiohttp.ClientSession) -> dict[str, Any]:
    a = bench.args
    if not a.deliver:
        bench.write_config(deliver=False)
    serve = await serve_started(bench, bench.work / "serve.log")
    conn = await asyncpg.connect(bench.db_url)
    results: dict[str, Any] = {}
    try:
        pg_pids = await pg_profile.server_processes(conn)
        bench_backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
        workers = workers_of(serve)
        groups = {"pigeon supervisor": [serve.pid], "pigeon workers": workers}
        groups["smtp-sink"] = [p.pid for p in bench.procs[:1]]
        if a.webhook != "none":
            groups["webhook receiver"] = [p.pid for p in bench.procs[1:2]]
        xacts = await transactions(conn)
        cpu = Cpu(groups, pg_pids)
        own_cpu = time.process_time()
        latencies: list[float] = []
        statuses: Counter[int] = Counter()
        began = time.monotonic()
        if a.via == "smtp":
            load = asyncio.ensure_future(
                ended(asyncio.to_thread(bench.smtp_source(a.messages).wait))
            )
        elif a.via == "outbox":
            load = asyncio.ensure_future(ended(bench.outbox_writers(a.messages)))
        else:
            requests = api_requests(a.via, a.messages, a.size, key)
            clients = (
                api_client(bench.api_port, requests, latencies, statuses) for _ in range(a.clients)
            )
            load = asyncio.ensure_future(ended(asyncio.gather(*clients)))
        accepted_at = delivered_at = drained_at = None
        max_depth = max_backlog = 0
        backlog_samples: list[tuple[float, int]] = []
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if accepted_at is None and load.done():
                accepted_at = load.result()
            depth = int(
                await conn.fetchval(
                    "SELECT count(*) FROM recipient WHERE status IN ('queued','delivering')"
                )
            )
            max_depth = max(max_depth, depth)
            done = await delivered(conn)
            if a.webhook != "none":
                backlog = await pending_events(conn)
                max_backlog = max(max_backlog, backlog)
                backlog_samples.append((round(now - began, 2), backlog))
            if delivered_at is None and accepted_at is not None and done >= a.messages:
                delivered_at = now
            if not a.deliver and accepted_at is not None:
                break
            if delivered_at is not None:
                if a.webhook == "none" or (await received(http, a.receiver_port))["unique"] >= done:
                    drained_at = now
                    break
            if now - began > a.timeout:
                print(f"timed out: {done} of {a.messages} delivered", file=sys.stderr)
                break
        finished = time.monotonic()
        used = cpu.used()
        used["bench (clients, polling)"] = time.process_time() - own_cpu
        pg_used = cpu.postgresql()
        wall = (delivered_at or finished) - began
        accepted = int(await conn.fetchval("SELECT count(*) FROM message"))
        done = await delivered(conn)
        accept_wall = (accepted_at or finished) - began
        results["send"] = {
            "via": a.via,
            "messages_offered": a.messages,
            "accepted": accepted,
            "statuses": dict(statuses),
            "accept_rate": round(accepted / accept_wall, 1),
            "latency_ms": {
                "p50": round(percentile(latencies, 0.5) * 1000, 1),
                "p99": round(percentile(latencies, 0.99) * 1000, 1),
                "max": round(max(latencies, default=0.0) * 1000, 1),
            },
            "delivered": done,
            "e2e_rate": round(done / wall, 1) if a.deliver else None,
            "max_queue_depth": max_depth,
            "wall_s": round(wall, 1),
            "cpu_s": {k: round(v, 1) for k, v in used.items()},
            "cores_busy": {k: round(v / (finished - began), 2) for k, v in used.items()},
            "postgresql_cpu_ms_per_message": round(
                (used["postgresql"] - pg_used.get(bench_backend, 0.0)) * 1000 / max(1, accepted), 3
            ),
            "workers_cpu_ms_per_message": round(
                used["pigeon workers"] * 1000 / max(1, accepted), 3
            ),
            "db_transactions_per_message": round(
                (await transactions(conn) - xacts) / max(1, accepted), 2
            ),
            **saturation(cpu, finished - began, workers, used),
        }
        if a.webhook != "none":
            got = await received(http, a.receiver_port)
            results["webhooks"] = {
                "events_received": got["events"],
                "unique": got["unique"],
                "events_per_s": round(got["unique"] / max(1e-9, got["last"] - began), 1),
                "max_backlog": max_backlog,
                "outbox_empty_after_last_delivery_s": (
                    round(drained_at - delivered_at, 2) if drained_at and delivered_at else None
                ),
                "backlog_every_second": backlog_samples[3::4],
            }
        results["peak_rss_mb"] = {
            f"pid {p}": round(peak_rss_mb(p), 1) for p in [serve.pid, *workers]
        }
    finally:
        await conn.close()
        stop_serve(serve)
    return results


# ---------------------------------------------------------------- --part drain


async def part_drain(bench: Bench, http: aiohttp.ClientSession) -> dict[str, Any]:
    a = bench.args
    # While the outbox fills, the webhook points at a port bound by the bench and not listening:
    # each event's one request is refused at once, and retried a day later.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    conn = await asyncpg.connect(bench.db_url)
    await conn.execute(
        "UPDATE webhook SET url = $1", f"http://127.0.0.1:{closed.getsockname()[1]}/hook"
    )
    bench.write_config(webhooks_extra='retry_initial = "1d"\nretry_max = "1d"\nmax_age = "30d"\n')
    serve = await serve_started(bench, bench.work / "fill.log")
    try:
        began = time.monotonic()
        try:
            await asyncio.to_thread(bench.smtp_source(a.messages).wait)
            while await delivered(conn) < a.messages:
                if time.monotonic() - began > a.timeout:
                    raise SystemExit(f"only {await delivered(conn)} of {a.messages} delivered")
                await asyncio.sleep(0.25)
        finally:
            stop_serve(serve)
            closed.close()
        filled = await pending_events(conn)
        sent_early = (await received(http, a.receiver_port))["events"]
        await conn.execute("UPDATE webhook SET url = $1", bench.receiver_url)
        # Not due while `serve` starts, so that its start-up is not counted with the drain: the
        # senders see them at their next poll (webhooks.poll_interval, 1 s) after they are due.
        await conn.execute(
            "UPDATE webhook_event SET next_attempt_at = now() + interval '1 day' "
            "WHERE state = 'pending'"
        )
        bench.write_config()
        serve = await serve_started(bench, bench.work / "serve.log")
        await asyncio.sleep(2)
        workers = workers_of(serve)
        groups = {"pigeon workers": workers, "webhook receiver": [bench.procs[1].pid]}
        xacts = await transactions(conn)
        cpu = Cpu(groups, await pg_profile.server_processes(conn))
        bench_backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
        began = time.monotonic()
        await conn.execute(
            "UPDATE webhook_event SET next_attempt_at = now() WHERE state = 'pending'"
        )
        samples: list[tuple[float, int]] = []
        while True:
            backlog = await pending_events(conn)
            samples.append((round(time.monotonic() - began, 2), backlog))
            if not backlog or time.monotonic() - began > a.timeout:
                break
            await asyncio.sleep(0.5)
        used = cpu.used()
        wall = time.monotonic() - began
        got = await received(http, a.receiver_port)
        span = got["last"] - got["first"]
        pg_used = cpu.postgresql()
        used["postgresql"] -= pg_used.get(bench_backend, 0.0)  # the bench's polling is not pigeon's
        xacts_after = await transactions(conn)
        states = dict(
            await conn.fetch("SELECT state, count(*) FROM webhook_event GROUP BY state")  # type: ignore[arg-type]
        )
        return {
            "drain": {
                "events_in_outbox": filled,
                "sent_while_filling": sent_early,
                "events_received": got["events"],
                "unique": got["unique"],
                "states": states,
                "events_per_s_first_to_last": round(got["unique"] / max(1e-9, span), 1),
                "events_per_s_from_due": round(got["unique"] / max(1e-9, got["last"] - began), 1),
                "due_to_first_event_s": round(got["first"] - began, 2),
                "cores_busy": {k: round(v / max(1e-9, wall), 2) for k, v in used.items()},
                "cpu_ms_per_event": {
                    k: round(v * 1000 / max(1, got["unique"]), 3) for k, v in used.items()
                },
                # The bench's polling (two transactions a second) included.
                "db_transactions_per_event": round(
                    (xacts_after - xacts) / max(1, got["unique"]), 2
                ),
                "backlog_over_time": samples,
                **saturation(cpu, wall, workers, used),
            }
        }
    finally:
        await conn.close()
        stop_serve(serve)


# ---------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> None:
    for tool in ("smtp-source", "smtp-sink"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"{tool} is missing: apt-get install postfix")
    if args.part == "drain" and args.webhook == "none":
        args.webhook = "delivered"
    bench = Bench(args)
    args.receiver_port = bench.receiver_port
    try:
        key, _hook = await bench.setup(args.dkim, args.webhook)
        bench.start_sink()
        if args.webhook != "none":
            bench.procs.append(
                await start_receiver(bench.receiver_port, bench.work / "receiver.log")
            )
        async with aiohttp.ClientSession() as http:
            if args.part == "drain":
                results = await part_drain(bench, http)
            else:
                results = await part_send(bench, key, http)
    finally:
        await bench.teardown()
    print(
        f"# api_bench --part {args.part} {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
        f"{platform.node()}, {os.cpu_count()} cores, processes={args.processes}, via={args.via}, "
        f"dkim={args.dkim}, webhook={args.webhook}, delivery={args.deliver}, "
        f"load {os.getloadavg()[0]:.1f}, {args.size} B messages, {args.clients} clients"
    )
    print(json.dumps(results, indent=2, default=float))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--part", choices=["send", "drain"], default="send")
    parser.add_argument("--via", choices=["json", "raw", "smtp", "outbox"], default="json")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=20, help="connections (or SMTP sessions)")
    parser.add_argument("--size", type=int, default=5120)
    parser.add_argument("--dkim", choices=["rsa", "ed25519", "none"], default="rsa")
    parser.add_argument(
        "--webhook",
        choices=["none", "delivered", "all"],
        default="none",
        help="a webhook of the org to the receiver, for these events",
    )
    parser.add_argument(
        "--no-delivery",
        dest="deliver",
        action="store_false",
        help="delivery.enabled = false: the accept rate alone",
    )
    parser.add_argument(
        "--sender-policy",
        choices=["strict", "envelope", "off"],
        help="relay.sender_policy (default: the config's own, strict)",
    )
    parser.add_argument(
        "--concurrency-per-endpoint",
        dest="concurrency_per_endpoint",
        type=int,
        help="webhooks.concurrency_per_endpoint (default: the config's own, 8)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="a part gives up after this")
    parser.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.receiver:
        receiver_main(arguments.receiver)
    else:
        asyncio.run(main(arguments))
