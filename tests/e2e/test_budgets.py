"""Budgets shared by the cluster and adaptive backoff, with the real `pigeon-mta serve`.

test --SQL--> PostgreSQL <--claim / grants / record-- serve node-a, node-b (2 processes each)
                                                         \\--SMTP--> sinks 127.0.0.2, .3, .4

Each domain has a static route to a sink of its own, so each sink sees one budget's traffic.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.node import STALE_AFTER
from tests.conftest import free_port, run_pigeon
from tests.e2e.faults_helpers import admin_execute, database_name, fetch, terminate_backends
from tests.e2e.serve_process import ServeProcess, write_config
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

SINK_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
DOMAINS = ("a.test", "b.test", "c.test")


@pytest.fixture
async def sinks() -> AsyncIterator[dict[str, tuple[SinkState, int]]]:
    """A sink per domain: a.test -> 127.0.0.2, b.test -> 127.0.0.3, c.test -> 127.0.0.4."""
    states: dict[str, tuple[SinkState, int]] = {}
    servers = []
    try:
        for domain, host in zip(DOMAINS, SINK_HOSTS, strict=True):
            state = SinkState(slow_seconds=0.3)
            server = await start_sink(state, host)
            servers.append(server)
            states[domain] = (state, server.sockets[0].getsockname()[1])
        yield states
    finally:
        await stop_servers(servers)


def node_config(
    directory: Path,
    db_url: str,
    node: str,
    sinks: dict[str, tuple[SinkState, int]],
    *,
    processes: int,
    extra: str = "",
    delivery: str = "",
    lease: str = "5s",
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    routes = "\n".join(
        f'"{domain}" = "{host}:{sinks[domain][1]}"'
        for domain, host in zip(DOMAINS, SINK_HOSTS, strict=True)
    )
    return write_config(
        directory,
        f"""listener = []
[server]
node_name = "{node}"
hostname = "{node}.test"
data_dir = "{directory}"
processes = {processes}
shutdown_timeout = "3s"
[database]
url = "{db_url}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
lease = "{lease}"
sweep_interval = "1s"
poll_interval = "200ms"
retry_initial = "1s"
retry_max = "2s"
{delivery}
[delivery.routes]
{routes}
{extra}
""",
    )


async def start_node(config: Path, processes: int) -> ServeProcess:
    serve = ServeProcess("--config", str(config))
    deadline = time.monotonic() + 60
    while serve.output.count("delivery engine started") < processes:
        assert time.monotonic() < deadline and serve.proc.poll() is None, serve.output
        await asyncio.sleep(0.1)
    return serve


async def stop(serve: ServeProcess) -> int:
    return await asyncio.to_thread(serve.stop, signal.SIGTERM, 60)


async def queue_to(
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    domain: str,
    count: int,
    *,
    local: str = "user",
    lane: str = "transactional",
) -> None:
    """`count` one-recipient messages to `local+N@domain` in `lane`, due now, in one statement."""
    await pool.execute(
        """
        WITH m AS (
            INSERT INTO message (id, org_id, sender, size, body, listener, received_at, lane)
            SELECT gen_random_uuid(), $1, 'sender@example.com', 30,
                   'Subject: t\r\n\r\nbody\r\n', 'test',
                   now() - make_interval(secs => ($2 - i) / 100000.0), $5
            FROM generate_series(1, $2) AS i
            RETURNING id, received_at
        ), r AS (
            INSERT INTO recipient (id, message_id, org_id, address, domain, created_at,
                                   next_attempt_at, lane)
            SELECT gen_random_uuid(), m.id, $1, $3 || '+' || m.id || '@' || $4, $4,
                   m.received_at, m.received_at, $5
            FROM m
        )
        SELECT pg_notify('pigeon_queue', '')
        """,
        org_id,
        count,
        local,
        domain,
        lane,
    )


def rate_in_window(state: SinkState, start: float, seconds: float) -> float:
    """Messages the sink accepted per second in [start, start + seconds) (time.time())."""
    return sum(1 for m in state.messages if start <= m.at < start + seconds) / seconds


async def wait_for_first(state: SinkState, timeout: float = 60) -> float:
    await state.wait_for(lambda: bool(state.messages), timeout)
    return state.messages[0].at


WINDOW = 30  # seconds of steady state measured
RATE = 50  # each budget's, messages a second


@pytest.mark.slow
async def test_destination_org_and_lane_rates_hold_across_two_nodes_of_two_processes(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    """rate = RATE for a destination (a.test), an org (`org set --rate`, mail to b.test) and a
    lane (bulk, mail to c.test): each sink sees RATE messages a second, +-10%, in steady state.

    Measured over 30 s: a bucket lets its capacity (a second's worth) through at once after a
    pause, and a delivery claimed before the window may reach the sink inside it; over 15 s those
    edges alone made 111 of 100 on a slow host. RATE is 50, not more, so that four processes on
    a slow host sharing its 2 cores with the suite's other worker still keep up with three
    budgets (at 100 each, 77-104 there)."""
    env = {"PIGEON_DATABASE_URL": db_url}
    assert run_pigeon("org", "add", "limited", env=env).returncode == 0
    result = run_pigeon("org", "set", "limited", "--rate", str(RATE), env=env)
    assert result.returncode == 0, result.stderr
    limited = await pool.fetchval("SELECT id FROM org WHERE name = 'limited'")
    for state, _ in sinks.values():
        state.slow_seconds = 0
    extra = f'[delivery.destination."a.test"]\nrate = {RATE}\n[lanes.bulk]\nrate = {RATE}\n'
    backlog = 50 * RATE  # for the 4 s of start-up and the 30 s measured, and then some
    await queue_to(pool, org_id, "a.test", backlog)
    await queue_to(pool, limited, "b.test", backlog)
    await queue_to(pool, org_id, "c.test", backlog, lane="bulk")
    nodes = [
        await start_node(node_config(tmp_path / n, db_url, n, sinks, processes=2, extra=extra), 2)
        for n in ("node-a", "node-b")
    ]
    try:
        firsts = {d: await wait_for_first(state) for d, (state, _) in sinks.items()}
        await asyncio.sleep(max(firsts.values()) + 4 + WINDOW - time.time() + 0.5)
    finally:
        codes = [await stop(node) for node in nodes]
    assert codes == [0, 0], [node.output for node in nodes]
    rates = {d: rate_in_window(sinks[d][0], firsts[d] + 4, WINDOW) for d in DOMAINS}
    assert all(0.9 * RATE <= rate <= 1.1 * RATE for rate in rates.values()), rates
    # Every node delivered to every budget: the budget is shared, not one node's.
    for domain in DOMAINS:
        helos = {m.helo for m in sinks[domain][0].messages}
        assert helos == {"node-a.test", "node-b.test"}, (domain, helos)


async def test_destination_concurrency_holds_for_two_processes_pooled_sessions_included(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    state, _ = sinks["a.test"]
    extra = '[delivery.destination."a.test"]\nconcurrency = 5\n'
    await queue_to(pool, org_id, "a.test", 60, local="slow")
    config = node_config(tmp_path, db_url, "node-a", sinks, processes=2, extra=extra)
    serve = await start_node(config, 2)
    try:
        await state.wait_for(lambda: len(state.messages) == 60, 90)
        # Idle pooled connections beyond the held slots are closed before they are given back.
        await state.wait_for(lambda: state.sessions == 0, 30)
    finally:
        assert await stop(serve) == 0, serve.output
    assert 2 <= state.max_sessions <= 5, state.max_sessions
    assert collections.Counter(state.deliveries().values()) == {1: 60}
    # Mail that found no slot went back unattempted: one attempt each.
    assert await pool.fetchval("SELECT max(attempts) FROM recipient") == 1


async def test_throttling_replies_lower_the_clusters_budget_and_quiet_raises_it_again(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    """A sink answers 421 4.7.0 while it took 50 messages within a second: the destination's
    budget records the decrease (backing off, its effective rate below what was being sent),
    mail waiting for it is handed back unattempted and says why; once the sink stops throttling,
    each quiet period raises the rate again until the backoff ends, at the rate it was throttled
    at (nothing is configured: it is capped there, not let loose). Nothing is bounced, lost or
    sent twice. (How fast it settles, and at what rate, is bench/'s to measure: a loaded
    machine sends slower whatever the budget allows.)"""
    state, _ = sinks["a.test"]
    state.slow_seconds = 0
    state.throttle_above = 50
    await queue_to(pool, org_id, "a.test", 3200)
    delivery = 'backoff_quiet = "2s"\nbackoff_step = 0.25'
    config = node_config(tmp_path, db_url, "node-a", sinks, processes=2, delivery=delivery)
    serve = await start_node(config, 2)
    env = {"PIGEON_DATABASE_URL": db_url}
    route = f"route:127.0.0.2:{sinks['a.test'][1]}"
    key = "destination:" + route
    try:
        await state.wait_for(lambda: bool(state.throttled), 60)
        lowered = await _budget_when(pool, key, lambda b: b["backoff"], "backing off")
        assert 0 < lowered["effective_rate"] < lowered["recover_rate"], dict(lowered)
        assert "421 4.7.0" in lowered["last_reply"]
        # The commands run in threads: the sink answers meanwhile. A sink that stops reading
        # while they run takes the backlog it then finds in one burst, and throttles it.
        why = await _postponed_story(pool, env)
        shown = await asyncio.to_thread(run_pigeon, "queue", env=env)
        # The destination stops throttling: every quiet period steps the rate back up.
        state.throttle_above = 0
        # From where it stands now: under load the budget may have decreased again since.
        lowest = (await _budget_when(pool, key, lambda b: True, "read"))["effective_rate"]
        raised = await _budget_when(pool, key, lambda b: b["effective_rate"] > lowest, "raised", 60)
        recovered = await _budget_when(pool, key, lambda b: not b["backoff"], "recovered", 90)
    finally:
        assert await stop(serve) == 0, serve.output
    assert raised["effective_rate"] > lowest
    # No rate configured: it stays at what it took when it was throttled, not unlimited.
    assert recovered["effective_rate"] == recovered["recover_rate"] > 0, dict(recovered)
    # Nothing bounced, lost or sent twice: what the sink took is recorded delivered, once each,
    # and the rest waits in the queue (the stop handed back what was claimed).
    received = state.deliveries()
    assert set(received.values()) == {1}
    rows = await pool.fetch("SELECT address, status FROM recipient")
    assert {r["address"] for r in rows if r["status"] == "delivered"} == set(received)
    assert {r["status"] for r in rows} <= {"delivered", "queued"}
    assert f"destination {route}" in shown.stdout and "backing off" in shown.stdout, shown.stdout
    assert "421 4.7.0 Try again later" in shown.stdout, shown.stdout
    assert "backing off after throttling replies" in why, why


async def _budget_when(
    pool: asyncpg.Pool,
    key: str,
    condition: Callable[[asyncpg.Record], bool],
    what: str,
    timeout: float = 30,
) -> asyncpg.Record:
    """The budget row `key` once `condition` holds for it (polled)."""
    deadline = time.monotonic() + timeout
    while True:
        row = await pool.fetchrow(
            "SELECT backoff, effective_rate, recover_rate, last_reply FROM budget WHERE key = $1",
            key,
        )
        if row is not None and condition(row):
            return row
        assert time.monotonic() < deadline, f"budget {key} not {what} within {timeout}s: {row}"
        await asyncio.sleep(0.1)


async def _postponed_story(pool: asyncpg.Pool, env: dict[str, str]) -> str:
    """`pigeon-mta log` of a message whose recipient waits for the destination's backoff,
    handed back without an attempt counted."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        queue_id = await pool.fetchval(
            "SELECT message_id FROM recipient"
            " WHERE postponed LIKE '%backing off%' AND attempts = 0 LIMIT 1"
        )
        if queue_id is not None:
            result = await asyncio.to_thread(run_pigeon, "log", str(queue_id), env=env)
            if "not tried yet" in result.stdout and "backing off" in result.stdout:
                return result.stdout
        await asyncio.sleep(0.1)
    return "no recipient was postponed for the backoff"


async def test_a_node_killed_with_a_session_slot_frees_it_within_its_heartbeats_staleness(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    """node-a holds a.test's only session slot (concurrency 1) under a 5-minute lease and is
    killed mid-DATA: node-b's mail to a.test goes out once node-a's heartbeat is stale (30 s,
    pigeon_mta/node.py STALE_AFTER), not when the lease ends."""
    state, _ = sinks["a.test"]
    extra = '[delivery.destination."a.test"]\nconcurrency = 1\n'
    await queue_to(pool, org_id, "a.test", 1, local="hang-data")
    first = await start_node(
        node_config(
            tmp_path / "a", db_url, "node-a", sinks, processes=1, extra=extra, lease="300s"
        ),
        1,
    )
    try:
        await state.wait_for(lambda: bool(state.messages), 30)
        held = await pool.fetchval(
            "SELECT sum(slots) FROM budget_slot WHERE holder LIKE 'node-a/%'"
        )
        assert held == 1
    finally:
        first.kill()
    killed = time.time()
    second = await start_node(
        node_config(
            tmp_path / "b", db_url, "node-b", sinks, processes=1, extra=extra, lease="300s"
        ),
        1,
    )
    try:
        await queue_to(pool, org_id, "a.test", 1, local="after")
        await state.wait_for(lambda: any("after+" in m.rcpt_tos[0] for m in state.messages), 60)
    finally:
        assert await stop(second) == 0, second.output
    arrived = next(m.at for m in state.messages if "after+" in m.rcpt_tos[0])
    # Stale 30 s after its last heartbeat (at most 30 s after the kill); then the next claim of
    # the message handed back, and its transaction.
    assert arrived - killed <= STALE_AFTER + 3, arrived - killed


async def test_a_budgeted_destination_delivers_everything_once_after_the_database_went_away(
    tmp_path: Path,
    db_url: str,
    admin_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sinks: dict[str, tuple[SinkState, int]],
) -> None:
    """The database goes away for 2 s (every session cut, new ones refused) while a destination
    with a cluster rate and concurrency drains a backlog: grants cannot be taken, and the mail
    waiting for them is neither lost, bounced nor delivered twice; delivery resumes by itself."""
    state, _ = sinks["a.test"]
    state.slow_seconds = 0
    count = 400
    await queue_to(pool, org_id, "a.test", count)
    await pool.close()  # the outage would cut its sessions too; later reads use fresh ones
    extra = '[delivery.destination."a.test"]\nrate = 50\nconcurrency = 4\n'
    config = node_config(tmp_path, db_url, "node-a", sinks, processes=1, extra=extra)
    serve = await start_node(config, 1)
    name = database_name(db_url)
    try:
        await state.wait_for(lambda: len(state.messages) >= 50, 60)
        await admin_execute(admin_url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        await terminate_backends(admin_url, name)
        await asyncio.sleep(2)
        await admin_execute(admin_url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        await state.wait_for(lambda: len(state.deliveries()) == count, 90)
        assert serve.proc.poll() is None, serve.output
    finally:
        await admin_execute(admin_url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        assert await stop(serve) == 0, serve.output
    assert collections.Counter(state.deliveries().values()) == {1: count}
    statuses = await fetch(db_url, "SELECT status, count(*) AS n FROM recipient GROUP BY status")
    assert {r["status"]: r["n"] for r in statuses} == {"delivered": count}
