"""Delivery to far-away destinations: pigeon's throughput when every packet takes a round trip.

    smtp-source --SMTP (loopback)--> relay listener of `pigeon-mta serve` (root namespace)
        --> PostgreSQL --> engine --SMTP--> tun NEAR ==[delay_link: RTT/2 each way]== tun FAR
        --> far network namespace: smtp-sink on 0.0.0.0:25, one address per destination

`netem` is missing from this kernel, so bench/delay_link.c (compiled here with gcc) holds every IP
packet for half the round trip in each direction between a TUN device in this namespace and one in
a namespace the bench creates. Destination i is the domain d<i>.lat.test, MX mx.d<i>.lat.test, A
10.201.x.y on the far side, answered by a loopback DNS server (tests/peers/dns_server.py) in this
process. pigeon runs with its default configuration apart from the DNS server, the listener and
the delivery-tuning flags given; no DKIM.

Cases: `one` (1 destination, 50 ms round trip) and `fifty` (50 destinations, 200 ms). Reported:
delivered msgs/s (all messages over the time to the last delivery, and the steady rate between 10%
and 90% delivered), the cores used by pigeon, PostgreSQL and the peers, the most SMTP sessions open
to the far side at once, peak RSS per pigeon process, and what held the rate: the CPU, a configured
limit (the sessions reached it), or neither. Root only (namespaces, TUN); bounded in count and time;
every process stopped by its PID and the namespace deleted at the end.

    .venv/bin/python bench/latency.py --case one [--count 20000] [--concurrency N]
        [--destination-concurrency N] [--max-connections-per-host N] [--processes N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import pg_profile  # noqa: E402
from bench.e2e import (  # noqa: E402
    Cpu,
    children,
    delivered,
    free_port,
    peak_rss_mb,
    run,
    saturation,
    start_serve,
    stop_serve,
    with_db,
    write_config,
)
from pigeon_mta.config import DeliverySettings  # noqa: E402
from tests.peers.dns_server import DnsServer  # noqa: E402

CASES = {"one": (1, 50.0), "fifty": (50, 200.0)}
NEAR_ADDRESS = "10.200.0.1"
FAR_NET = "10.201.0.0/16"
FAR_NET_HEX = "C90A"  # 10.201, as the last bytes of /proc/net/tcp's little-endian address
# smtp-sink serves 256 sessions at once unless told otherwise; the rest wait unaccepted.
MAX_SINK_SESSIONS = 10000
# Settings pigeon applies when the config leaves them out (pigeon_mta/config.py), for the report.
DEFAULTS = {
    key: getattr(DeliverySettings(), key)
    for key in ("concurrency", "destination_concurrency", "max_connections_per_host")
}


def far_address(index: int) -> str:
    return f"10.201.{index // 200}.{index % 200 + 1}"


def domain(index: int) -> str:
    return f"d{index}.lat.test"


def tool(name: str) -> str:
    found = shutil.which(name) or (
        f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else ""
    )
    if not found:
        sys.exit(f"{name} is missing: apt-get install {'postfix' if 'smtp' in name else name}")
    return found


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@dataclass
class FarSide:
    """The far network namespace, the delay link into it and the sink inside it."""

    namespace: str
    link: subprocess.Popen[str]
    sink: subprocess.Popen[bytes] | None

    def stop(self) -> str:
        """Stop the sink and the link (by PID), delete the namespace; the link's counts."""
        for proc in (self.sink, self.link):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        counts = self.link.stderr.read() if self.link.stderr else ""
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, timeout=30)
        return counts.strip()


def build_link(work: Path) -> Path:
    binary = work / "delay_link"
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-o", str(binary), str(REPO / "bench" / "delay_link.c")],
        check=True,
        timeout=120,
    )
    return binary


def start_far_side(binary: Path, destinations: int, rtt_ms: float) -> FarSide:
    """Namespace, delayed link, addresses, routes and an smtp-sink on port 25 of every address."""
    tag = os.getpid() % 100000
    namespace, near, far = f"pigeon-lat-{tag}", f"plat{tag}n", f"plat{tag}f"
    if subprocess.run(["ip", "route", "show", FAR_NET], capture_output=True, text=True).stdout:
        sys.exit(f"a route to {FAR_NET} exists already: is another latency bench running?")
    ip("netns", "add", namespace)
    link = subprocess.Popen(
        [str(binary), near, f"/var/run/netns/{namespace}", far, str(int(rtt_ms * 500))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sink: subprocess.Popen[bytes] | None = None
    try:
        if link.stdout is None or link.stdout.readline().strip() != "ready":
            raise SystemExit(
                "delay_link did not start: " + (link.stderr.read() if link.stderr else "")
            )
        ip("link", "set", near, "up")
        ip("addr", "add", f"{NEAR_ADDRESS}/32", "dev", near)
        ip("route", "add", FAR_NET, "dev", near, "src", NEAR_ADDRESS)
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", namespace, "link", "set", far, "up")
        for i in range(destinations):
            ip("-n", namespace, "addr", "add", f"{far_address(i)}/32", "dev", far)
        ip("-n", namespace, "route", "add", f"{NEAR_ADDRESS}/32", "dev", far)
        sink = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                tool("smtp-sink"),
                "-u",
                "nobody",
                "-m",
                str(MAX_SINK_SESSIONS),
                "0.0.0.0:25",
                "4096",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except BaseException:
        FarSide(namespace, link, sink).stop()
        raise
    return FarSide(namespace, link, sink)


def sessions_to_far_side() -> int:
    """TCP connections established from this namespace to port 25 on the far side."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        if state == "01" and remote.endswith(":0019") and remote[4:8] == FAR_NET_HEX:
            count += 1
    return count


def pigeon_config(
    args: argparse.Namespace,
    work: Path,
    db_url: str,
    ports: dict[str, int],
    dns: DnsServer,
    delivering: bool = True,
) -> str:
    server = f"processes = {args.processes}\n" if args.processes is not None else ""
    delivery = "".join(
        f"{key} = {getattr(args, key)}\n" for key in DEFAULTS if getattr(args, key) is not None
    )
    if not delivering:
        delivery += "enabled = false\n"
    return f"""
[server]
hostname = "bench.test"
data_dir = "{work}"
node_name = "latency"
{server}[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{ports["relay"]}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.0/8"]
[delivery]
{delivery}[dns]
nameservers = ["{dns.nameserver}"]
[metrics]
listen = "127.0.0.1:{ports["metrics"]}"
[log]
delivery_log = "{work / "delivery.log"}"
"""


def start_load(
    args: argparse.Namespace, destinations: int, relay_port: int
) -> list[subprocess.Popen[bytes]]:
    """One smtp-source per destination, the messages and sessions split evenly between them."""
    sessions = max(1, args.sessions // destinations)
    loads = []
    for i in range(destinations):
        count = args.count // destinations + (1 if i < args.count % destinations else 0)
        loads.append(
            subprocess.Popen(
                [
                    tool("smtp-source"),
                    "-d",
                    "-s",
                    str(sessions),
                    "-l",
                    str(args.size),
                    "-m",
                    str(count),
                    "-f",
                    "sender@bench.test",
                    "-t",
                    f"rcpt@{domain(i)}",
                    f"127.0.0.1:{relay_port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return loads


async def report_stuck(conn: asyncpg.Connection) -> None:
    """Where the undelivered recipients are, and the replies of the attempts that did not deliver."""
    for row in await conn.fetch("SELECT status, count(*) FROM recipient GROUP BY 1"):
        print(f"  {row[0]}: {row[1]}", file=sys.stderr)
    for row in await conn.fetch(
        "SELECT outcome, code, left(response, 120), count(*) FROM attempt"
        " WHERE outcome <> 'delivered' GROUP BY 1, 2, 3 ORDER BY 4 DESC LIMIT 5"
    ):
        print(f"  attempt {row[0]} {row[1]} {row[2]!r}: {row[3]}", file=sys.stderr)


def what_held(
    limits: dict[str, int], processes: int, destinations: int, peak: int, cpu_verdict: str
) -> str:
    """The configured limit the connections reached (and the CPU if it was saturated too), else
    what saturation() found."""
    ceilings = {
        "concurrency": limits["concurrency"],
        "destination_concurrency": destinations * limits["destination_concurrency"],
        "max_connections_per_host": destinations * limits["max_connections_per_host"],
    }
    name = min(ceilings, key=lambda k: ceilings[k])
    ceiling = processes * ceilings[name]
    # Open connections include idle pooled ones, so they can pass the transactions' ceiling.
    if peak >= 0.9 * ceiling:
        reached = (
            f"{name} ({limits[name]} per process: at most {ceiling} transactions at once;"
            f" {peak} connections open)"
        )
        # Idle pooled connections count too, so a saturated CPU may be what held it instead.
        return f"{reached}; {cpu_verdict}" if cpu_verdict.startswith("CPU") else reached
    return f"{cpu_verdict}; {peak} connections open, the limits allow {ceiling} transactions"


async def queue_depth(conn: asyncpg.Connection) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM recipient WHERE status IN ('queued', 'delivering')"
        )
    )


async def measure(
    args: argparse.Namespace,
    conn: asyncpg.Connection,
    serve: subprocess.Popen[str],
    side: FarSide,
    destinations: int,
    relay_port: int,
    prefilled: bool,
) -> dict[str, object]:
    workers = [
        p
        for p in children(serve.pid)
        if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    cpu = Cpu(
        {
            "pigeon supervisor": [serve.pid],
            "pigeon workers": workers,
            "smtp-sink": [side.sink.pid] if side.sink else [],
            "delay_link": [side.link.pid],
        },
        await pg_profile.server_processes(conn),
    )
    began = time.monotonic()
    loads = [] if prefilled else start_load(args, destinations, relay_port)
    accepted_at, marks, peak, done, depth = None, {}, 0, 0, 0
    try:
        while time.monotonic() - began < args.timeout:
            await asyncio.sleep(0.5)
            if accepted_at is None and all(p.poll() is not None for p in loads):
                accepted_at = time.monotonic()
            peak = max(peak, sessions_to_far_side())
            done = await delivered(conn)
            depth = max(depth, await queue_depth(conn))
            for fraction in (0.1, 0.9):
                if fraction not in marks and done >= fraction * args.count:
                    marks[fraction] = (time.monotonic(), done)
            if done >= args.count:
                break
        else:
            print(
                f"timed out after {args.timeout} s: {done} of {args.count} delivered",
                file=sys.stderr,
            )
            await report_stuck(conn)
    finally:
        for load in loads:
            if load.poll() is None:
                load.kill()
            load.wait(10)
    finished = time.monotonic()
    used = cpu.used()
    wall = finished - began
    steady = 0.0
    if 0.1 in marks and 0.9 in marks and marks[0.9][0] > marks[0.1][0]:
        steady = (marks[0.9][1] - marks[0.1][1]) / (marks[0.9][0] - marks[0.1][0])
    verdict = saturation(cpu, wall, workers, used)
    limits = {
        k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS.items()
    }
    processes = args.processes or os.cpu_count() or 1
    held = what_held(limits, processes, destinations, peak, str(verdict["saturated"]))
    if not prefilled and depth < 0.05 * args.count:
        held = f"the offered load: delivery kept up with acceptance (queue depth at most {depth})"
    accept = (
        {}
        if prefilled
        else {"accept_msgs_per_s": round(args.count / ((accepted_at or finished) - began), 1)}
    )
    return {
        "delivered": done,
        "delivered_msgs_per_s": round(done / wall, 1),
        "steady_msgs_per_s": round(steady, 1),
        **accept,
        "max_queue_depth": depth,
        "wall_s": round(wall, 1),
        "cores_busy": {k: round(v / wall, 2) for k, v in used.items()},
        "peak_sessions": peak,
        "peak_rss_mb": [round(peak_rss_mb(p), 1) for p in [serve.pid, *workers]],
        **verdict,
        "held_by": held,
        "limits": {**limits, "processes": processes},
    }


async def prefill(args: argparse.Namespace, destinations: int, relay_port: int) -> float:
    """Queue every message through the relay listener; the accept rate (msgs/s)."""
    began = time.monotonic()
    loads = start_load(args, destinations, relay_port)
    try:
        while any(p.poll() is None for p in loads):
            if time.monotonic() - began > args.timeout:
                raise SystemExit(f"queueing {args.count} messages took over {args.timeout} s")
            await asyncio.sleep(0.2)
    finally:
        for load in loads:
            if load.poll() is None:
                load.kill()
            load.wait(10)
    return float(args.count) / (time.monotonic() - began)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--case", choices=sorted(CASES), default="one")
    parser.add_argument(
        "--destinations", type=int, help="overrides the case's number of destinations"
    )
    parser.add_argument("--rtt-ms", type=float, help="overrides the case's round trip")
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--size", type=int, default=5120)
    parser.add_argument("--sessions", type=int, default=20, help="smtp-source sessions in all")
    parser.add_argument(
        "--timeout", type=float, default=900, help="give up after this many seconds"
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="queue every message first (delivery.enabled = false), then time the drain alone",
    )
    parser.add_argument("--processes", type=int, help="server.processes (default: the config's)")
    parser.add_argument("--concurrency", type=int, help="delivery.concurrency")
    parser.add_argument("--destination-concurrency", dest="destination_concurrency", type=int)
    parser.add_argument("--max-connections-per-host", dest="max_connections_per_host", type=int)
    args = parser.parse_args()
    destinations = args.destinations or CASES[args.case][0]
    rtt_ms = args.rtt_ms if args.rtt_ms is not None else CASES[args.case][1]
    if os.geteuid() != 0:
        sys.exit("bench/latency.py creates a network namespace and TUN devices: run it as root")
    if not 1 <= destinations <= 10000:
        sys.exit("--destinations must be between 1 and 10000")
    for name in ("ip", "gcc", "smtp-sink", "smtp-source"):
        tool(name)

    work = Path(tempfile.mkdtemp(prefix="pigeon-latency-"))
    name = f"pigeon_latency_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_db(args.url, name)
    ports = {"relay": free_port(), "metrics": free_port()}
    dns = await DnsServer().start()
    for i in range(destinations):
        dns.mx(domain(i), (10, f"mx.{domain(i)}"), ttl=3600)
        dns.a(f"mx.{domain(i)}", far_address(i), ttl=3600)
    side: FarSide | None = None
    serve: subprocess.Popen[str] | None = None
    results: dict[str, object] = {}
    try:
        side = start_far_side(build_link(work), destinations, rtt_ms)
        config = work / "pigeon.toml"
        write_config(config, pigeon_config(args, work, db_url, ports, dns))
        pig = [sys.executable, "-m", "pigeon_mta"]
        run([*pig, "migrate", "--config", str(config)])
        run([*pig, "org", "add", "internal", "--config", str(config)])
        run([*pig, "domain", "add", "internal", "bench.test", "--config", str(config)])
        processes = args.processes or os.cpu_count() or 1
        accept_rate = None
        if args.prefill:
            write_config(config, pigeon_config(args, work, db_url, ports, dns, delivering=False))
            serve = await start_serve(config, work / "accept.log", processes)
            accept_rate = await prefill(args, destinations, ports["relay"])
            stop_serve(serve)
            write_config(config, pigeon_config(args, work, db_url, ports, dns))
        serve = await start_serve(config, work / "serve.log", processes)
        conn = await asyncpg.connect(db_url)
        try:
            results = await measure(
                args, conn, serve, side, destinations, ports["relay"], args.prefill
            )
        finally:
            await conn.close()
        if accept_rate is not None:
            results["prefill_accept_msgs_per_s"] = round(accept_rate, 1)
    finally:
        if serve is not None:
            stop_serve(serve)
        if side is not None:
            results["delay_link"] = side.stop()
        await dns.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"# latency {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {destinations} destination(s) at "
        f"{rtt_ms:g} ms round trip, {args.count} x {args.size} B, no DKIM, "
        f"{'prefilled queue' if args.prefill else 'accepting while delivering'}"
    )
    print(json.dumps(results, indent=2))
    if "held_by" in results:
        print(f"held by: {results['held_by']}")


if __name__ == "__main__":
    # SIGTERM (`timeout`, a supervisor) unwinds like Ctrl-C, so the cleanup in main() still runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit("interrupted: the processes, namespace, scratch database and files are cleaned up")
