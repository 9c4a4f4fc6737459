"""Soak: steady load with temporary and permanent failures; nothing accepted may end unaccounted for.

    paced SMTP client (20 sessions) --> relay listener of `pigeon-mta serve --processes 2` (DKIM RSA)
        --> PostgreSQL --> engine --relayhost--> aiosmtpd sink process on loopback
                                                  (5% of recipients: 451 once, then accepted;
                                                   1% of recipients: 550 5.1.1 always)

Offers --rate msgs/s for --minutes; every --every seconds it samples the queue (live recipients,
age of the oldest due one) and each pigeon process's RSS. At the end it waits for the queue to
drain and checks that every accepted message's recipients reached a final state (delivered or
bounced, with DSNs for the bounces), and reports memory growth. Bounded; loopback only.

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 200]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.e2e import (  # noqa: E402
    children,
    free_port,
    message_bytes,
    smtp_session,
    stop_serve,
    with_db,
    write_config,
)


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_sink(port: int) -> None:
    """The sink process: local part "temp..." gets 451 the first time, "perm..." always 550."""
    from aiosmtpd.smtp import SMTP

    seen: set[str] = set()

    class Handler:
        async def handle_RCPT(
            self, server: object, session: object, envelope: object, address: str, options: object
        ) -> str:
            local = address.split("@", 1)[0]
            if local.startswith("perm"):
                return "550 5.1.1 no such user"
            if local.startswith("temp") and address not in seen:
                seen.add(address)
                return "451 4.7.1 try again later"
            envelope.rcpt_tos.append(address)  # type: ignore[attr-defined]
            return "250 2.1.5 OK"

        async def handle_DATA(self, server: object, session: object, envelope: object) -> str:
            return "250 2.0.0 accepted"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: SMTP(Handler(), hostname="sink.test"), "127.0.0.2", port
        )
        async with server:
            await server.serve_forever()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(main())


async def load(
    port: int, rate: float, seconds: float, sessions: int, stats: dict[str, int]
) -> None:
    interval = sessions / rate
    start = time.monotonic()
    rng = random.Random(7)

    async def session(index: int) -> None:
        writer, reply = await smtp_session(port, "soak.bench.test")
        due = start + index * interval / sessions
        n = index
        while time.monotonic() - start < seconds:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            roll = rng.random()
            local = f"temp{n}" if roll < 0.05 else f"perm{n}" if roll < 0.06 else f"ok{n}"
            writer.write(b"MAIL FROM:<sender@bench.test>\r\n")
            await reply()
            writer.write(f"RCPT TO:<{local}@sink.test>\r\n".encode())
            await reply()
            writer.write(b"DATA\r\n")
            await reply()
            writer.write(message_bytes(5120, n) + b".\r\n")
            answer = await reply()
            stats["accepted" if answer.startswith(b"250") else "refused"] += 1
            n += sessions
            due += interval
        writer.write(b"QUIT\r\n")
        await reply()
        writer.close()

    await asyncio.gather(*(session(i) for i in range(sessions)))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=200, help="offered msgs/s (half capacity)")
    parser.add_argument("--every", type=float, default=30)
    parser.add_argument(
        "--delay-warning-after",
        default="0",
        help='bounces.delay_warning_after (e.g. "5s": the 451-once recipients, retried after 10 s, '
        "get delay warnings; each recipient at most one)",
    )
    args = parser.parse_args()
    name = f"pigeon_soak_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_db(args.url, name)
    work = Path(tempfile.mkdtemp(prefix="pigeon-soak-"))
    relay_port, sink_port = free_port(), free_port()
    config = work / "pigeon.toml"
    write_config(
        config,
        f"""[server]
hostname = "bench.test"
data_dir = "{work}"
node_name = "soak"
processes = 2
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{relay_port}"
[relay]
trusted_networks = ["127.0.0.0/8"]
[delivery]
relayhost = "127.0.0.2:{sink_port}"
relayhost_tls = "none"
retry_initial = "10s"
retry_max = "30s"
[bounces]
delay_warning_after = "{args.delay_warning_after}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[log]
delivery_log = "{work}/delivery.log"
""",
    )
    pig = [sys.executable, "-m", "pigeon_mta"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for cmd in (
        ["migrate"],
        ["org", "add", "internal"],
        ["domain", "add", "internal", "bench.test"],
        ["dkim", "keygen", "bench.test", "--selector", "s1"],
    ):
        subprocess.run(
            [*pig, *cmd, "--config", str(config)], check=True, env=env, capture_output=True
        )
    sink = multiprocessing.get_context("spawn").Process(target=run_sink, args=(sink_port,))
    sink.start()
    log = open(work / "serve.log", "w")
    serve = subprocess.Popen(
        [*pig, "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    conn = await asyncpg.connect(db_url)
    stats = {"accepted": 0, "refused": 0}
    samples: list[tuple[float, int, float, float]] = []
    try:
        deadline = time.monotonic() + 60
        while (work / "serve.log").read_text().count("listener relay bound") < 2:
            if time.monotonic() > deadline:
                raise SystemExit("serve did not start")
            await asyncio.sleep(0.2)
        workers = children(serve.pid)
        began = time.monotonic()
        loader = asyncio.create_task(load(relay_port, args.rate, args.minutes * 60, 20, stats))
        while not loader.done():
            await asyncio.wait({loader}, timeout=args.every)
            live = int(
                await conn.fetchval(
                    "SELECT count(*) FROM recipient WHERE status IN ('queued','delivering')"
                )
            )
            age = float(
                await conn.fetchval(
                    "SELECT COALESCE(extract(epoch FROM now() - min(next_attempt_at)), 0) FROM recipient WHERE status='queued' AND next_attempt_at <= now()"
                )
            )
            rss = max(rss_mb(p) for p in workers)
            samples.append((time.monotonic() - began, live, age, rss))
            print(
                f"t={samples[-1][0]:6.0f}s accepted={stats['accepted']} live={live} oldest_due={age:.1f}s worker_rss_max={rss:.1f}MB",
                flush=True,
            )
        await loader
        drain_deadline = time.monotonic() + 120
        while time.monotonic() < drain_deadline:
            live = int(
                await conn.fetchval(
                    "SELECT count(*) FROM recipient WHERE status IN ('queued','delivering')"
                )
            )
            if live == 0:
                break
            await asyncio.sleep(1)
        by_status = {
            r["status"]: r["n"]
            for r in await conn.fetch(
                "SELECT r.status, count(*) AS n FROM recipient r JOIN message m ON m.id = r.message_id WHERE m.listener = 'relay' GROUP BY 1"
            )
        }
        dsns = int(await conn.fetchval("SELECT count(*) FROM message WHERE listener = 'bounce'"))
        warnings = int(
            await conn.fetchval(
                "SELECT count(*) FROM message WHERE listener = 'bounce' "
                "AND position('Action: delayed'::bytea IN body) > 0"
            )
        )
        warned = int(
            await conn.fetchval("SELECT count(*) FROM recipient WHERE delay_warned_at IS NOT NULL")
        )
        messages = int(await conn.fetchval("SELECT count(*) FROM message WHERE listener = 'relay'"))
        print(
            f"# soak {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {args.minutes:g} min at {args.rate:g} msgs/s offered"
        )
        print(
            f"| accepted (250) | {stats['accepted']} | refused | {stats['refused']} | rows | {messages} |"
        )
        print(f"| final states | {by_status} | DSNs queued | {dsns} |")
        print(
            f"| of those, delay warnings (Action: delayed) | {warnings} | recipients marked warned "
            f"| {warned} |"
        )
        unaccounted = stats["accepted"] - sum(
            n for s, n in by_status.items() if s in ("delivered", "bounced")
        )
        print(f"| accepted but not final after drain | {unaccounted} |")
        print(
            f"| max live recipients | {max(s[1] for s in samples)} | max oldest-due age | {max(s[2] for s in samples):.1f}s |"
        )
        print(
            f"| worker RSS first / last sample | {samples[0][3]:.1f} MB / {samples[-1][3]:.1f} MB |"
        )
    finally:
        await conn.close()
        stop_serve(serve)
        sink.terminate()
        sink.join(10)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
