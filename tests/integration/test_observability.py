"""Metrics added up over real worker processes, readiness, and the HTTP endpoint on a real socket.

worker processes ──(multiprocess files)──► MetricsExposition ◄── this process (the supervisor)
                                                  │
                             ObservabilityServer (127.0.0.1:free port) ◄── HTTP client
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from pigeon_mta import metrics
from pigeon_mta.config import HostPort
from pigeon_mta.observability.exposition import MetricsExposition, remove_stale_directories
from pigeon_mta.observability.health import Readiness
from pigeon_mta.observability.http import ObservabilityServer
from tests.conftest import REPO, free_port
from tests.integration.api_helpers import running_api
from tests.observe_helpers import http, promtool

WORKER = textwrap.dedent(
    """
    import sys
    from pigeon_mta import metrics
    n = int(sys.argv[1])
    metrics.DELIVERIES.labels(outcome="delivered").inc(n)
    metrics.DELIVERY_ATTEMPT_SECONDS.observe(0.02 * n)
    metrics.OUTBOUND_CONNECTIONS_OPEN.set(n)
    metrics.QUEUE_OLDEST_AGE.labels(lane="bulk").set(999)  # a worker's copy of a supervisor-owned gauge
    print("done", flush=True)
    sys.stdin.read()  # stay alive until told to go
    """
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def here(name: str, **labels: str) -> float:
    """This process's own (the supervisor's) value of a sample."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """Two real processes in multiprocess mode that recorded 2 and 3 deliveries."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(n)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in (2, 3)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "done\n"
        yield tmp_path, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_counters_histograms_and_live_gauges_add_up_over_processes(
    workers: tuple[Path, list[subprocess.Popen[str]]],
) -> None:
    directory, procs = workers
    exposition = MetricsExposition(directory)
    metrics.DELIVERIES.labels(outcome="delivered").inc()
    metrics.QUEUE_OLDEST_AGE.labels(lane="bulk").set(42.5)
    mine = here("pigeon_deliveries_total", outcome="delivered")
    my_count = here("pigeon_delivery_attempt_seconds_count")
    my_open = here("pigeon_outbound_connections_open")

    text = exposition.render().decode()
    got = samples(text)
    assert got[("pigeon_deliveries_total", (("outcome", "delivered"),))] == 2 + 3 + mine
    assert got[("pigeon_delivery_attempt_seconds_count", ())] == 2 + my_count
    le = here("pigeon_delivery_attempt_seconds_bucket", le="0.05")
    assert got[("pigeon_delivery_attempt_seconds_bucket", (("le", "0.05"),))] == 1 + le
    assert got[("pigeon_outbound_connections_open", ())] == 5 + my_open
    # the supervisor's, not 999
    assert got[("pigeon_queue_oldest_age_seconds", (("lane", "bulk"),))] == 42.5
    labels = {dict(k[1]).get("process") for k in got if k[0] == "process_cpu_seconds_total"}
    assert labels == {"supervisor"}
    subprocess.run([promtool(), "check", "metrics"], input=text, text=True, check=True)

    # A worker that died stops counting in live gauges; its counters still count.
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
        exposition.worker_exited(proc.pid)
    got = samples(exposition.render().decode())
    assert got[("pigeon_outbound_connections_open", ())] == my_open
    assert got[("pigeon_deliveries_total", (("outcome", "delivered"),))] == 2 + 3 + mine


def test_worker_processes_get_their_own_process_metrics(
    workers: tuple[Path, list[subprocess.Popen[str]]],
) -> None:
    directory, procs = workers
    exposition = MetricsExposition(directory)
    for index, proc in enumerate(procs):
        exposition.worker_started(index, proc.pid)
    got = samples(exposition.render().decode())
    rss = {
        dict(labels)["process"]: value
        for (name, labels), value in got.items()
        if name == "process_resident_memory_bytes"
    }
    assert set(rss) == {"supervisor", "worker-0", "worker-1"}
    assert all(value > 0 for value in rss.values())


def test_with_one_process_the_registry_is_the_exposition() -> None:
    text = MetricsExposition(None).render().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"pigeon_deliveries", "pigeon_queue_recipients", "process_cpu_seconds"} <= names


def test_a_killed_supervisors_metrics_directory_is_removed_by_the_next_start(
    tmp_path: Path,
) -> None:
    """A supervisor killed with SIGKILL cannot remove its multiprocess directory; the next start
    removes the directories whose supervisor is gone, and leaves a running one's alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"pigeon-mta-metrics-{gone.pid}-abc123"
    running = tmp_path / f"pigeon-mta-metrics-{os.getpid()}-def456"
    unrelated = tmp_path / "pigeon-mta-metrics-notapid"
    for directory in (stale, running, unrelated):
        directory.mkdir()
        (directory / "counter_1.db").write_bytes(b"x")
    assert remove_stale_directories(tmp_path) == [stale]
    assert not stale.exists() and running.exists() and unrelated.exists()


def test_the_supervisor_names_its_metrics_directory_after_itself() -> None:
    exposition = MetricsExposition.for_processes(2)
    try:
        assert exposition.multiprocess_dir is not None
        assert exposition.multiprocess_dir.name.startswith(f"pigeon-mta-metrics-{os.getpid()}-")
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(exposition.multiprocess_dir)
    finally:
        exposition.close()
    assert not exposition.multiprocess_dir.exists()
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


# ---------------------------------------------------------------- readiness and HTTP


@pytest.fixture
def gauges() -> Iterator[None]:
    """This process plays a worker: its readiness gauges start at 0 and are put back after."""
    for gauge in (
        metrics.WORKERS_READY,
        metrics.LISTENERS_BOUND.labels(listener="relay"),
        metrics.LISTENERS_BOUND.labels(listener="submission"),
        metrics.LISTENERS_BOUND.labels(listener="api"),
    ):
        gauge.set(0)
    yield
    metrics.WORKERS_READY.set(0)
    metrics.LISTENERS_BOUND.labels(listener="relay").set(0)
    metrics.LISTENERS_BOUND.labels(listener="submission").set(0)
    metrics.LISTENERS_BOUND.labels(listener="api").set(0)


@pytest.fixture
async def server(pool: asyncpg.Pool, gauges: None) -> AsyncIterator[ObservabilityServer]:
    exposition = MetricsExposition(None)
    readiness = Readiness(pool, exposition, ["relay", "submission"], 1, asyncio.Event())
    server = ObservabilityServer(HostPort("127.0.0.1", free_port()), exposition, readiness)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return await asyncio.to_thread(http, port, path, method)


async def test_ready_needs_a_worker_and_every_listener_bound(server: ObservabilityServer) -> None:
    status, _headers, body = await get(server.port, "/readyz")
    assert status == 503
    lines = body.decode().splitlines()
    assert lines[0] == "not ready"
    assert "database: ok (reachable)" in lines
    assert "workers: FAIL (0 of 1 worker process(es) ready)" in lines
    assert "listener relay: FAIL (bound in 0 process(es))" in lines

    metrics.WORKERS_READY.set(1)
    metrics.LISTENERS_BOUND.labels(listener="relay").set(1)
    status, _headers, body = await get(server.port, "/readyz")
    assert status == 503
    assert "listener relay: ok (bound in 1 process(es))" in body.decode()
    assert "listener submission: FAIL (bound in 0 process(es))" in body.decode()

    metrics.LISTENERS_BOUND.labels(listener="submission").set(1)
    status, _headers, body = await get(server.port, "/readyz")
    assert status == 200 and body.decode().startswith("ready\n")

    server.readiness.stopping.set()
    status, _headers, body = await get(server.port, "/readyz")
    assert status == 503 and "stopping" in body.decode()
    assert (await get(server.port, "/healthz"))[0] == 200


async def test_not_ready_while_the_http_api_is_not_bound(pool: asyncpg.Pool, gauges: None) -> None:
    """The API's listener counts as an SMTP listener does: bound while its ApiService listens."""
    exposition = MetricsExposition(None)
    readiness = Readiness(pool, exposition, ["api"], 1, asyncio.Event())
    server = ObservabilityServer(HostPort("127.0.0.1", free_port()), exposition, readiness)
    await server.start()
    try:
        metrics.WORKERS_READY.set(1)
        status, _headers, body = await get(server.port, "/readyz")
        assert status == 503
        assert "listener api: FAIL (bound in 0 process(es))" in body.decode().splitlines()
        async with running_api(pool):
            status, _headers, body = await get(server.port, "/readyz")
            assert status == 200, body
            assert "listener api: ok (bound in 1 process(es))" in body.decode().splitlines()
        status, _headers, body = await get(server.port, "/readyz")
        assert status == 503 and "listener api: FAIL" in body.decode()
    finally:
        await server.stop()


async def test_http_answers_metrics_health_and_errors(server: ObservabilityServer) -> None:
    status, headers, body = await get(server.port, "/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE pigeon_deliveries_total counter" in body
    status, headers, body = await get(server.port, "/metrics", "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    status, _headers, body = await get(server.port, "/healthz")
    assert (status, body) == (200, b"ok\n")
    assert (await get(server.port, "/nothing"))[0] == 404
    assert (await get(server.port, "/metrics", "POST"))[0] == 405

    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"HELLO\r\n\r\n")
    await writer.drain()
    # A request line that is no HTTP names no version: the answer may be in HTTP/1.0.
    assert re.match(rb"HTTP/1\.[01] 400 Bad Request\r\n", await reader.read())
    writer.close()
