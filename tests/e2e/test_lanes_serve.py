"""Lanes in the running node: the queue gauges per lane, a lane's own max_age at expiry, and the
warning at start about users whose lane the settings dropped.

HTTP client ──► 127.0.0.1:free port (/metrics) ── pigeon-mta serve (delivery off) ── PostgreSQL
                                                   └─ its sweeper expires what is too old
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import asyncpg

from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess
from tests.e2e.test_observability import (
    Samples,
    check_exposition,
    eventually,
    observe_config,
    samples,
    scrape,
    value,
)
from tests.integration.queue_helpers import bulk_queue

# delivery.max_age stays 1h (observe_config); the bulk lane's is 10 minutes.
LANES = """
[lanes.bulk]
max_age = "10m"
[lanes.notify]
weight = 5
"""


def seed(db_url: str) -> None:
    """Bulk: 3 due for 2 minutes, 2 queued 30 minutes ago (past the lane's max_age). Transactional:
    1 queued 30 minutes ago (within delivery.max_age), 1 deferred and not due."""

    async def run() -> None:
        conn = await asyncpg.connect(db_url)
        try:
            from pigeon_mta.store.credentials import add_credential
            from pigeon_mta.store.orgs import ensure_org

            org = await ensure_org(conn, "acme")
            await bulk_queue(conn, org, messages=3, due_in=-120, age=120, lane="bulk")
            await bulk_queue(
                conn, org, messages=2, due_in=-60, age=1800, lane="bulk", domain="old.example"
            )
            await bulk_queue(conn, org, messages=1, due_in=-60, age=1800, domain="app.example")
            await bulk_queue(conn, org, messages=1, due_in=600, domain="later.example")
            await conn.execute("UPDATE recipient SET attempts = 1 WHERE domain = 'later.example'")
            # A user whose lane the settings no longer have (set before they changed).
            await add_credential(conn, org, "old-campaigns", "x", lane="retired")
        finally:
            await conn.close()

    asyncio.run(run())


def test_gauges_per_lane_the_lane_max_age_and_users_outside_the_lanes(
    tmp_path: Path, db_url: str
) -> None:
    seed(db_url)
    port = free_port()
    config = observe_config(tmp_path, db_url, port, extra=LANES)
    serve = ServeProcess("--config", str(config), "--processes", "1")
    try:
        serve.wait_for(f"metrics and health on http://127.0.0.1:{port}")
        serve.wait_for(
            "user(s) old-campaigns have the lane 'retired', which is not a lane of [lanes]"
        )

        def expired_and_published() -> Samples | None:
            got = samples(scrape(port))
            if value(got, "pigeon_deliveries_total", outcome="expired") != 2:
                return None
            bulk = value(got, "pigeon_queue_recipients", status="queued", lane="bulk")
            return got if bulk == 3 else None

        got = eventually(expired_and_published, "the bulk lane's expiry in the gauges")
        queued = {
            lane: value(got, "pigeon_queue_recipients", status="queued", lane=lane)
            for lane in ("bulk", "transactional", "notify")
        }
        # Transactional: its old recipient and the 2 DSNs the expiry queued for the sender.
        assert queued == {"bulk": 3, "transactional": 3, "notify": 0}
        assert value(got, "pigeon_queue_recipients", status="deferred", lane="transactional") == 1
        assert value(got, "pigeon_queue_recipients", status="deferred", lane="bulk") == 0
        # Each lane's longest wait since its recipient became due.
        ages = {
            lane: value(got, "pigeon_queue_oldest_age_seconds", lane=lane) or 0
            for lane in ("bulk", "transactional")
        }
        assert 120 <= ages["bulk"] < 600 and 60 <= ages["transactional"] < 120, ages
        assert value(got, "pigeon_queue_oldest_age_seconds", lane="notify") == 0
        check_exposition(scrape(port))

        records = [json.loads(line) for line in (tmp_path / "delivery.log").read_text().split("\n")
                   if line]  # fmt: skip
        assert [(r["type"], r["lane"]) for r in records] == [("Expiration", "bulk")] * 2
        for record in records:
            assert record["recipient"].endswith("@old.example")
            assert record["response"].startswith("expired after 10m in the queue")
        assert serve.stop(signal.SIGTERM) == 0, serve.output
    finally:
        serve.kill()
