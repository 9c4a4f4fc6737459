"""Throttle storm: a destination that answers 421 4.7.0 above a rate, and how pigeon settles.

    queue (PostgreSQL): --backlog messages to storm.test, due at once, no limits configured
    pigeon-mta serve (--processes) --SMTP (static route)--> aiosmtpd sink on 127.0.0.2 that answers
        "421 4.7.0 Too many messages, slow down" to every message past --limit in the last second

Reported per --window seconds: messages the sink accepted per second and 421s it gave; when the
rate first settled (a window without a 421 and at most --limit), whether a second storm came
after that (a window with more than --storm 421s), and at the end: every accepted message
recorded delivered once, nothing lost (delivered + queued = backlog) and nothing twice. Bounded in
count and time (--seconds); loopback only.

    .venv/bin/python bench/throttle_storm.py [--limit 50] [--backlog 20000] [--seconds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import signal
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
from bench.e2e import free_port, run, start_serve, stop_serve, with_db, write_config  # noqa: E402


class ThrottlingSink:
    """Accepts at most `limit` messages in any second; answers 421 to the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.accepted: list[tuple[float, str]] = []
        self.refused: list[float] = []
        self.lock = threading.Lock()
        self._recent: collections.deque[float] = collections.deque()

    async def handle_DATA(self, server: object, session: object, envelope: Any) -> str:
        now = time.monotonic()
        with self.lock:
            while self._recent and self._recent[0] < now - 1.0:
                self._recent.popleft()
            if len(self._recent) >= self.limit:
                self.refused.append(now)
                return "421 4.7.0 Too many messages, slow down"
            self._recent.append(now)
            for rcpt in envelope.rcpt_tos:
                self.accepted.append((now, rcpt.lower()))
        return "250 2.0.0 Ok"


def config_text(work: Path, db_url: str, sink_port: int, processes: int) -> str:
    return f"""listener = []
[server]
hostname = "storm.bench.test"
data_dir = "{work}"
node_name = "storm"
processes = {processes}
[database]
url = "{db_url}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
retry_initial = "5s"
retry_max = "30s"
[delivery.routes]
"storm.test" = "127.0.0.2:{sink_port}"
[log]
delivery_log = ""
"""


async def queue_backlog(conn: asyncpg.Connection, count: int) -> None:
    org = await conn.fetchval(
        "INSERT INTO org (id, name) VALUES (gen_random_uuid(), 'storm') RETURNING id"
    )
    await conn.execute(
        """
        WITH m AS (
            INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
            SELECT gen_random_uuid(), $1, 'news@storm.example', 40,
                   'Subject: storm\r\n\r\nbody\r\n', 'bench', now()
            FROM generate_series(1, $2)
            RETURNING id, received_at
        )
        INSERT INTO recipient (id, message_id, org_id, address, domain, created_at,
                               next_attempt_at)
        SELECT gen_random_uuid(), m.id, $1, 'r' || left(m.id::text, 13) || '@storm.test',
               'storm.test', m.received_at, m.received_at
        FROM m
        """,
        org,
        count,
    )


def windows(sink: ThrottlingSink, start: float, end: float, width: float) -> list[dict[str, float]]:
    out = []
    t = start
    while t < end:
        accepted = sum(1 for at, _ in sink.accepted if t <= at < t + width)
        refused = sum(1 for at in sink.refused if t <= at < t + width)
        seconds = min(width, end - t)  # the last window may be shorter
        out.append(
            {
                "from_s": round(t - start),
                "msgs_per_s": round(accepted / seconds, 1),
                "421s": refused,
            }
        )
        t += width
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--url",
        default=os.environ.get(
            "PIGEON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--limit", type=int, default=50, help="the sink's messages per second")
    parser.add_argument("--backlog", type=int, default=20000)
    parser.add_argument("--seconds", type=float, default=200, help="how long it runs")
    parser.add_argument("--window", type=float, default=10)
    parser.add_argument("--storm", type=int, default=10, help="421s in a window that are a storm")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pigeon-storm-"))
    name = f"pigeon_storm_{os.getpid()}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    db_url = with_db(args.url, name)
    sink = ThrottlingSink(args.limit)
    sink_port = free_port()
    controller = Controller(sink, hostname="127.0.0.2", port=sink_port)
    config = work / "pigeon.toml"
    write_config(config, config_text(work, db_url, sink_port, args.processes))
    serve = None
    result: dict[str, object] = {}
    controller.start()
    try:
        run([sys.executable, "-m", "pigeon_mta", "migrate", "--config", str(config)])
        conn = await asyncpg.connect(db_url)
        try:
            await queue_backlog(conn, args.backlog)
            started = time.monotonic()
            serve = await start_serve(
                config, work / "serve.log", args.processes, ready="delivery engine started"
            )
            await asyncio.sleep(max(0.0, started + args.seconds - time.monotonic()))
            ended = time.monotonic()
            stop_serve(serve)
            serve = None
            states = {
                r[0]: r[1]
                for r in await conn.fetch("SELECT status, count(*) FROM recipient GROUP BY 1")
            }
        finally:
            await conn.close()
        per_window = windows(sink, started, ended, args.window)
        settled = next(
            (w["from_s"] for w in per_window if w["421s"] == 0 and w["msgs_per_s"] <= args.limit),
            None,
        )
        storms_after = [
            w
            for w in per_window
            if settled is not None and w["from_s"] > settled and w["421s"] > args.storm
        ]
        received = collections.Counter(rcpt for _, rcpt in sink.accepted)
        result = {
            "windows": per_window,
            "settled_after_s": settled,
            "storms_after_settling": len(storms_after),
            "accepted": len(sink.accepted),
            "refused_421": len(sink.refused),
            "received_twice": sum(1 for n in received.values() if n > 1),
            "states_at_end": states,
            "unaccounted": args.backlog - sum(states.values()),
            "delivered_not_received": states.get("delivered", 0) - len(received),
        }
    finally:
        if serve is not None:
            stop_serve(serve)
        controller.stop()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"# throttle_storm {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, processes={args.processes}, "
        f"sink limit {args.limit}/s, backlog {args.backlog}, {args.seconds:g} s"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit("interrupted: the processes, the scratch database and files are cleaned up")
