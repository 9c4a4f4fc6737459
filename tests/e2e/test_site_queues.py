"""Fair inside a shared budget: tenants' mail to one site paced at one rate, through the real
`pigeon-mta serve` with two worker processes.

queue (PostgreSQL): 10,000 backlog messages to shop.shared.test, paced at 50/s with corp.shared.test
smtplib ──SMTP──► relay listener ── pigeon-mta serve (2 processes) ──SMTP──► aiosmtpd sink 127.0.0.2
              [delivery.destination."*.shared.test"] rate = 50: one budget for both domains

The mail that waits for the budget sits in the site's queue, untouched until the budget has room,
and that room is shared between the orgs and lanes waiting, so another org's (or lane's) mail to
the same site does not queue behind the backlog.
"""

from __future__ import annotations

import asyncio
import json
import smtplib
import time
import uuid
from email.message import EmailMessage
from pathlib import Path

import asyncpg

from pigeon_mta.store.orgs import ensure_org
from tests.conftest import free_port, run_pigeon
from tests.e2e.serve_process import ServeProcess, write_config
from tests.integration.queue_helpers import bulk_queue
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

BACKLOG = 10_000
RESETS = 20
RATE = 50  # the site's rate, messages a second, for both domains together


def config(tmp_path: Path, db_url: str, relay_port: int, sink_port: int) -> Path:
    return write_config(
        tmp_path,
        f"""
[server]
hostname = "mta.test"
data_dir = "{tmp_path}"
node_name = "e2e-site-queue"
processes = 2
shutdown_timeout = "5s"
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{relay_port}"
mode = "relay"
[relay]
trusted_networks = ["127.0.0.1/32"]
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery.routes]
"shop.shared.test" = "127.0.0.2:{sink_port}"
"corp.shared.test" = "127.0.0.2:{sink_port}"
[delivery.destination."*.shared.test"]
rate = {RATE}
[log]
delivery_log = ""
""",
    )


def send_reset(port: int, n: int) -> float:
    """One password reset over SMTP; returns when its 250 came (time.time())."""
    mail = EmailMessage()
    mail["From"] = "app@internal.test"
    mail["To"] = f"user{n}@corp.shared.test"
    mail["Subject"] = f"reset {n}"
    mail.set_content("your code is 123456\n")
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        assert client.send_message(mail) == {}
    return time.time()


async def row_writes(pool: asyncpg.Pool) -> int:
    """Recipient rows updated so far in this database (the statistics PostgreSQL keeps)."""
    await pool.execute("SELECT pg_stat_force_next_flush()")
    value = await pool.fetchval(
        "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'recipient'"
    )
    return int(value)


async def delivered(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'delivered'"))


async def resets_beside_backlog(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, backlog_org: uuid.UUID, lane: str
) -> list[float]:
    """Queue the backlog to shop.shared.test, let the site settle at its rate, send the resets
    to corp.shared.test; returns each reset's seconds from its 250 to the sink. Meanwhile the
    site keeps its rate, the backlog is still queued, and waiting mail is not rewritten."""
    await bulk_queue(
        pool, backlog_org, messages=BACKLOG, domain="shop.shared.test", lane=lane, age=60
    )
    state = SinkState(slow_seconds=0)
    sink = await start_sink(state, "127.0.0.2", 0)
    relay_port = free_port()
    serve = ServeProcess(
        "--config", str(config(tmp_path, db_url, relay_port, sink.sockets[0].getsockname()[1]))
    )
    try:
        await asyncio.to_thread(serve.wait_for, "listener relay bound on")
        started = time.monotonic()
        await state.wait_for(lambda: len(state.messages) >= 2 * RATE, timeout=60)
        deadline = time.monotonic() + 30
        while await pool.fetchval(
            "SELECT count(*) FROM recipient WHERE status = 'queued' AND site IS NULL"
        ):
            # The backlog's first claims found the budget empty: it joins the site's queue.
            assert time.monotonic() < deadline, "the backlog did not join its site's queue"
            await asyncio.sleep(0.2)
        # PostgreSQL's statistics lag behind (each backend reports its own, up to 10 s late when
        # it went idle): the start's writes (the backlog joining the site's queue, a write each)
        # are all counted before the window opens.
        while await row_writes(pool) < BACKLOG:
            assert time.monotonic() < deadline, "the statistics do not show the backlog joining"
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, started + 11 - time.monotonic()))
        # Steady state: what a delivered message costs in row writes from here on.
        writes_before, delivered_before = await row_writes(pool), await delivered(pool)
        window_start = time.time()
        await asyncio.sleep(4)
        accepted = [await asyncio.to_thread(send_reset, relay_port, n) for n in range(RESETS)]
        await state.wait_for(
            lambda: all(state.received_by(f"user{n}@corp.shared.test") for n in range(RESETS)),
            timeout=60,
        )
        await asyncio.sleep(4)
        window = time.time() - window_start
        writes = await row_writes(pool) - writes_before
        sent = await delivered(pool) - delivered_before
        waits = [
            state.received_by(f"user{n}@corp.shared.test")[0].at - accepted[n]
            for n in range(RESETS)
        ]
        still_queued = await pool.fetchval(
            "SELECT count(*) FROM recipient WHERE domain = 'shop.shared.test' AND status = 'queued'"
        )
        shown = await asyncio.to_thread(
            run_pigeon, "queue", "--json", env={"PIGEON_DATABASE_URL": db_url}
        )
    finally:
        serve.stop()
        await stop_servers([sink])
    in_window = sum(1 for m in state.messages if window_start <= m.at < window_start + window)
    assert in_window <= 1.1 * RATE * window, (in_window, window)
    assert in_window >= 0.8 * RATE * window, (in_window, window)
    assert still_queued > BACKLOG / 2, still_queued
    # `queue` shows the one budget of both domains, and the backlog waiting in its queue.
    assert shown.returncode == 0, shown.stderr
    [site] = json.loads(shown.stdout)["budgets"]
    assert site["key"] == "destination:pattern:*.shared.test", site
    assert site["waiting"] > BACKLOG / 2 and site["effective_rate"] == RATE, site
    # Each delivered message: it joined the site's queue, was claimed from it, and recorded.
    assert writes <= 3 * sent, (writes, sent)
    return waits


async def test_another_orgs_mail_to_the_same_site_does_not_queue_behind_a_backlog(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    acme = await ensure_org(pool, "acme")
    waits = await resets_beside_backlog(tmp_path, db_url, pool, acme, "transactional")
    assert max(waits) < 1.0, sorted(waits)


async def test_the_same_orgs_bulk_lane_does_not_hold_up_its_mail_to_the_same_site(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    internal = await ensure_org(pool, "internal")  # relay.trusted_org: the resets' org too
    waits = await resets_beside_backlog(tmp_path, db_url, pool, internal, "bulk")
    assert max(waits) < 1.0, sorted(waits)
