"""A dead site is parked: its mail waits unwritten in the site's queue while one probe at a time is
tried, and flows again once the site answers, through the real `pigeon-mta serve`.

queue (PostgreSQL): 500 messages to dead.test
pigeon-mta serve (2 processes) ──TCP──► 127.0.0.2:PORT, which accepts and never greets
                                 ...then an aiosmtpd sink on the same port
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import asyncpg

from pigeon_mta.store.orgs import ensure_org
from tests.conftest import free_port, run_pigeon
from tests.e2e.serve_process import ServeProcess, write_config
from tests.e2e.test_site_queues import row_writes
from tests.integration.queue_helpers import bulk_queue
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

MESSAGES = 500


def config(tmp_path: Path, db_url: str, port: int) -> Path:
    return write_config(
        tmp_path,
        f"""listener = []
[server]
hostname = "mta.test"
data_dir = "{tmp_path}"
node_name = "e2e-parked"
processes = 2
shutdown_timeout = "3s"
[database]
url = "{db_url}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
connect_timeout = "1s"
retry_initial = "2s"
retry_max = "4s"
park_after = 5
park_for = "3s"
park_max = "4s"
[delivery.routes]
"dead.test" = "127.0.0.2:{port}"
[log]
delivery_log = ""
""",
    )


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accept and never greet, until the peer goes."""
    await reader.read()
    writer.close()


def budgets(db_url: str) -> list[dict[str, object]]:
    shown = run_pigeon("queue", "--json", env={"PIGEON_DATABASE_URL": db_url})
    assert shown.returncode == 0, shown.stderr
    return list(json.loads(shown.stdout)["budgets"])


async def test_a_dead_site_is_parked_without_churn_and_flows_again_when_it_answers(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    org = await ensure_org(pool, "acme")
    await bulk_queue(pool, org, messages=MESSAGES, domain="dead.test")
    hole = await asyncio.start_server(silent, "127.0.0.2", 0)
    port = hole.sockets[0].getsockname()[1]
    serve = ServeProcess("--config", str(config(tmp_path, db_url, port)))
    servers = []
    try:
        await asyncio.to_thread(serve.wait_for, "delivery engine started")
        deadline = time.monotonic() + 30
        while (
            not (shown := await asyncio.to_thread(budgets, db_url)) or not shown[0]["parked_until"]
        ):
            assert time.monotonic() < deadline, (shown, serve.output[-3000:])
            await asyncio.sleep(0.5)
        [site] = shown
        assert site["key"] == f"destination:route:127.0.0.2:{port}" or "127.0.0.2" in str(
            site["key"]
        ), site
        # What was in flight finishes failing, and what was deferred joins the site's queue
        # when it is due again; from then on the site's mail waits, unwritten.
        while await pool.fetchval("SELECT count(*) FROM recipient WHERE site IS NULL"):
            assert time.monotonic() < deadline + 30, "the mail did not join the site's queue"
            await asyncio.sleep(0.5)
        before, began = await row_writes(pool), time.monotonic()
        since = await pool.fetchval("SELECT now()")
        await asyncio.sleep(8)
        rate = (await row_writes(pool) - before) / (time.monotonic() - began)
        # The mail waits unwritten: only the probes' rows are touched. (Those few rows take
        # 5-22 updates a second between them, more on a loaded host: bounded, not zero.)
        touched = await pool.fetchval(
            "SELECT count(*) FROM recipient WHERE updated_at >= $1", since
        )
        assert touched <= 10, touched
        assert rate <= 50, rate
        attempts = await pool.fetchval("SELECT count(*) FROM attempt")
        assert attempts < MESSAGES / 2, attempts  # most of the mail was never attempted
        waiting = (await asyncio.to_thread(budgets, db_url))[0]
        assert waiting["parked_until"] and waiting["waiting"] > MESSAGES / 2, waiting
        # The site answers again: the next probe finds it, and everything is delivered once.
        hole.close()
        await hole.wait_closed()
        state = SinkState(slow_seconds=0)
        servers.append(await start_sink(state, "127.0.0.2", port))
        await state.wait_for(lambda: len(state.messages) >= MESSAGES, timeout=60)
        assert len({tuple(m.rcpt_tos) for m in state.messages}) == MESSAGES
        assert not (await asyncio.to_thread(budgets, db_url) or [{}])[0].get("parked_until")
    finally:
        serve.stop()
        hole.close()
        await stop_servers(servers)
    log = serve.output
    assert "is parked after failed connections" in log and "no longer parked" in log, log[-3000:]
