"""The real `pigeon-mta serve` as Prometheus and a load balancer see it.

HTTP client ──► 127.0.0.1:free port (/metrics, /healthz, /readyz) ── pigeon-mta serve ── PostgreSQL
                                                                      └─ worker processes
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pigeon_mta.delivery_records import EVENT_FIELDS
from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config
from tests.integration.queue_helpers import bulk_queue
from tests.observe_helpers import http, promtool

# Every metric of the interface contract, as exposed (counters with _total).
CONTRACT_METRICS = {
    "pigeon_messages_accepted_total": "counter",
    "pigeon_smtp_rejections_total": "counter",
    "pigeon_auth_failures_total": "counter",
    "pigeon_queue_recipients": "gauge",
    "pigeon_queue_oldest_age_seconds": "gauge",
    "pigeon_deliveries_total": "counter",
    "pigeon_delivery_attempt_seconds": "histogram",
    "pigeon_accept_to_delivery_seconds": "histogram",
    "pigeon_outbound_connections_open": "gauge",
    "pigeon_outbound_connection_reuses_total": "counter",
    "pigeon_dkim_signatures_total": "counter",
}

T = TypeVar("T")
# The lane of the seeded mail (the default lane).
LANE = "transactional"


def observe_config(tmp_path: Path, db_url: str, port: int, extra: str = "") -> Path:
    return write_config(
        tmp_path,
        f"""listener = []
[server]
node_name = "observe-test"
data_dir = "{tmp_path}"
shutdown_timeout = "5s"
[database]
url = "{db_url}"
[metrics]
listen = "127.0.0.1:{port}"
stats_interval = "1s"
[delivery]
# Accept-only node: the seeded queue stays as seeded, so the gauges can be compared with it.
enabled = false
max_age = "1h"
sweep_interval = "1s"
[log]
delivery_log = "{tmp_path}/delivery.log"
{extra}""",
    )


def eventually(probe: Callable[[], T | None], what: str, timeout: float = 60) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def answered(port: int, path: str, status: int) -> tuple[int, dict[str, str], bytes] | None:
    try:
        answer = http(port, path)
    except OSError:  # not listening yet
        return None
    return answer if answer[0] == status else None


def scrape(port: int) -> str:
    status, headers, body = http(port, "/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return body.decode()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: Samples, name: str, **labels: str) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


def seed_queue(db_url: str) -> None:
    """5 due (waiting 2 minutes), 3 deferred (not due), 2 delivering, 4 past max_age."""

    async def seed() -> None:
        conn = await asyncpg.connect(db_url)
        try:
            from pigeon_mta.store.orgs import ensure_org

            org = await ensure_org(conn, "acme")
            await bulk_queue(conn, org, messages=5, due_in=-120, age=120)
            await bulk_queue(conn, org, messages=3, due_in=600, domain="deferred.example")
            await conn.execute(
                "UPDATE recipient SET attempts = 1 WHERE domain = 'deferred.example'"
            )
            await bulk_queue(conn, org, messages=2, status="delivering", domain="busy.example")
            await conn.execute(
                """UPDATE recipient SET lease_until = now() + interval '1 hour',
                   lease_owner = 'another-node' WHERE status = 'delivering'"""
            )
            await bulk_queue(conn, org, messages=4, due_in=-7200, age=7200, domain="old.example")
        finally:
            await conn.close()

    asyncio.run(seed())


def check_exposition(text: str) -> None:
    """Valid for Prometheus's own checker, and every contract metric is there with its type."""
    result = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind in CONTRACT_METRICS.items():
        assert types.get(name) == kind, f"{name} missing or not a {kind}"
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names)), "a metric family appears twice"


@pytest.fixture
def stop_later() -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for serve in started:
        serve.kill()


def test_one_process_metrics_health_queue_gauges_and_expiry(
    tmp_path: Path, db_url: str, stop_later: list[ServeProcess]
) -> None:
    seed_queue(db_url)
    port = free_port()
    serve = ServeProcess(
        "--config", str(observe_config(tmp_path, db_url, port)), "--processes", "1"
    )
    stop_later.append(serve)
    serve.wait_for(f"metrics and health on http://127.0.0.1:{port}")

    assert http(port, "/healthz")[0] == 200
    _status, _headers, body = eventually(lambda: answered(port, "/readyz", 200), "ready")
    assert body.decode().splitlines() == [
        "ready",
        "database: ok (reachable)",
        "workers: ok (1 of 1 worker process(es) ready)",
        "listener api: ok (bound in 1 process(es))",  # [api] listen, from write_config
        "recorder: ok (recording)",
    ]

    def queue_published() -> Samples | None:
        got = samples(scrape(port))
        return (
            got
            if value(got, "pigeon_queue_recipients", status="deferred", lane=LANE) == 3
            else None
        )

    got = eventually(queue_published, "queue gauges")
    # 5 seeded due recipients, plus the 4 bounces (one per expired message) that expiry queued
    # for the senders of the 4 expired recipients.
    assert value(got, "pigeon_queue_recipients", status="queued", lane=LANE) == 9
    assert value(got, "pigeon_queue_recipients", status="delivering", lane=LANE) == 2
    assert value(got, "pigeon_queue_due_recipients") == 9
    assert (value(got, "pigeon_queue_oldest_age_seconds", lane=LANE) or 0) >= 120
    # The sweeper expired the 4 recipients older than max_age: counted and logged.
    assert value(got, "pigeon_deliveries_total", outcome="expired") == 4
    assert value(got, "pigeon_workers_ready") == 1
    check_exposition(scrape(port))

    records = [json.loads(line) for line in (tmp_path / "delivery.log").read_text().splitlines()]
    assert [r["type"] for r in records] == ["Expiration"] * 4
    for record in records:
        assert tuple(record)[: len(EVENT_FIELDS)] == EVENT_FIELDS
        assert record["recipient"].endswith("@old.example")
        assert record["response"].startswith("expired after 1h in the queue")

    assert serve.stop(signal.SIGTERM) == 0, serve.output
    assert "Traceback" not in serve.output


def test_two_processes_add_up_and_a_dead_worker_is_accounted_for(
    tmp_path: Path, db_url: str, stop_later: list[ServeProcess]
) -> None:
    seed_queue(db_url)
    port = free_port()
    serve = ServeProcess(
        "--config", str(observe_config(tmp_path, db_url, port)), "--processes", "2"
    )
    stop_later.append(serve)
    serve.wait_for("worker 0 ready")
    serve.wait_for("worker 1 ready")

    def both_ready() -> Samples | None:
        got = samples(scrape(port))
        expired = value(got, "pigeon_deliveries_total", outcome="expired")
        return got if value(got, "pigeon_workers_ready") == 2 and expired == 4 else None

    got = eventually(both_ready, "two workers ready and the expiry counted")
    assert value(got, "pigeon_worker_starts_total") == 2
    assert processes(got) == {"supervisor", "worker-0", "worker-1"}
    check_exposition(scrape(port))
    assert http(port, "/readyz")[0] == 200
    multiproc_dir = Path(multiprocess_dir_of(worker_pids(serve.proc.pid)[0]))
    assert list(multiproc_dir.glob("*.db"))

    # A worker killed outright: its live gauges stop counting, a new one starts, counters go on.
    pid = int(serve.wait_for("started worker 1 (pid").rsplit("pid ", 1)[1].rstrip(")"))
    started_at = value(got, "process_start_time_seconds", process="worker-1")
    subprocess.run(["kill", "-KILL", str(pid)], check=True)
    serve.wait_for(f"worker 1 (pid {pid}) exited with -9; restarting")

    def restarted() -> Samples | None:
        got = samples(scrape(port))
        if value(got, "pigeon_worker_starts_total") != 3 or value(got, "pigeon_workers_ready") != 2:
            return None
        return got

    got = eventually(restarted, "worker 1 restarted")
    assert processes(got) == {"supervisor", "worker-0", "worker-1"}
    assert value(got, "process_start_time_seconds", process="worker-1") != started_at
    assert value(got, "pigeon_deliveries_total", outcome="expired") == 4
    check_exposition(scrape(port))

    assert serve.stop(signal.SIGTERM) == 0, serve.output
    assert not multiproc_dir.exists(), "the run's metrics directory is removed on stop"


def processes(got: Samples) -> set[str]:
    return {
        dict(labels)["process"]
        for (name, labels), _v in got.items()
        if name == "process_cpu_seconds_total"
    }


def worker_pids(pid: int) -> list[int]:
    """The worker processes of a serve (not multiprocessing's resource tracker)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def multiprocess_dir_of(pid: int) -> str:
    """The supervisor sets the variable for its workers after it started: read a worker's."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return entry.split(b"=", 1)[1].decode()
    raise AssertionError(f"worker {pid} has no PROMETHEUS_MULTIPROC_DIR")


def test_not_ready_while_the_database_is_gone(
    tmp_path: Path, admin_url: str, db_url: str, stop_later: list[ServeProcess]
) -> None:
    port = free_port()
    serve = ServeProcess(
        "--config", str(observe_config(tmp_path, db_url, port)), "--processes", "1"
    )
    stop_later.append(serve)
    serve.wait_for("worker 0 ready")
    eventually(lambda: answered(port, "/readyz", 200), "ready")

    name = db_url.rsplit("/", 1)[1]

    async def drop() -> None:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    asyncio.run(drop())
    _status, _headers, body = eventually(lambda: answered(port, "/readyz", 503), "not ready")
    assert "database: FAIL" in body.decode()
    assert http(port, "/healthz")[0] == 200  # alive all the same
    assert serve.stop(signal.SIGTERM) == 0, serve.output


def test_a_busy_metrics_port_or_an_unwritable_delivery_log_stops_the_start(
    tmp_path: Path, db_url: str
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        serve = ServeProcess("--config", str(observe_config(tmp_path, db_url, port)))
        assert serve.proc.wait(60) == 2
        serve.stop()
    assert f"cannot listen on 'metrics.listen' 127.0.0.1:{port}" in serve.output

    config = observe_config(
        tmp_path, db_url, free_port(), extra=f'delivery_log = "{tmp_path}/missing/dir/d.log"'
    )
    text = config.read_text().replace(f'delivery_log = "{tmp_path}/delivery.log"\n', "")
    config.write_text(text)
    serve = ServeProcess("--config", str(config))
    assert serve.proc.wait(60) == 2
    serve.stop()
    assert "cannot open 'log.delivery_log'" in serve.output


def test_log_level_and_format_come_from_the_config(
    tmp_path: Path, db_url: str, stop_later: list[ServeProcess]
) -> None:
    port = free_port()
    config = observe_config(tmp_path, db_url, port)
    config.write_text(config.read_text() + 'level = "warning"\nformat = "json"\n')
    serve = ServeProcess("--config", str(config), "--processes", "2", env={"PIGEON_LOG_LEVEL": ""})
    stop_later.append(serve)
    eventually(lambda: answered(port, "/readyz", 200), "ready")
    subprocess.run(["kill", "-KILL", str(worker_pids(serve.proc.pid)[0])], check=True)
    serve.wait_for("restarting")
    assert serve.stop(signal.SIGTERM) == 0, serve.output
    events = [json.loads(line) for line in serve.output.splitlines() if line]
    assert events and all(e["level"] in ("warning", "error") for e in events)
    assert any("exited with -9; restarting" in e["message"] for e in events)
