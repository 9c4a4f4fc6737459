"""Faults under load against the real `pigeon-mta serve`: kill -9, the database going away or
turning read-only, a peer that hangs after DATA, and a thousand idle connections.

Every test runs the same shape (details in each docstring):

    smtplib / raw sockets (test) --SMTP--> relay listener 127.0.0.1:<port> (pigeon-mta serve)
        pigeon-mta serve --SQL--> PostgreSQL (this test's own database)
        pigeon-mta serve --SMTP (relayhost)--> sink 127.0.0.2:<port> (in the test)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import resource
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.e2e.faults_helpers import (
    LoadClient,
    Reply,
    admin_execute,
    alive,
    assert_no_crash,
    database_name,
    delivered_ids,
    fetch,
    node_config,
    send,
    start_serve,
    status_counts,
    stop_serve,
    terminate_backends,
    wait_delivered,
    wait_until,
)
from tests.e2e.serve_process import descendants
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers


@pytest.fixture
async def sink() -> AsyncIterator[tuple[SinkState, int]]:
    state = SinkState(slow_seconds=0.3)
    server = await start_sink(state, "127.0.0.2")
    try:
        yield state, server.sockets[0].getsockname()[1]
    finally:
        await stop_servers([server])


# ---------------------------------------------------------------- the tests


@pytest.mark.slow
async def test_kill_9_of_every_process_during_load_loses_nothing_accepted(
    tmp_path: Path, db_url: str, sink: tuple[SinkState, int]
) -> None:
    """Topology: a smtplib client thread --SMTP--> serve (supervisor + 2 workers, node "faults")
    --relayhost--> sink 127.0.0.2 that answers each final dot after 0.3 s (so transactions are in
    flight). Mid-load every pigeon process gets SIGKILL; serve starts again with the same node name.
    Every message the client saw 250 for reaches the sink (matched by the queue id in the Received
    header); a message is delivered twice only if its recipient was `delivering` when the processes
    died (the sink had answered but the result was never recorded), so duplicates <= those rows."""
    state, port = sink
    node = node_config(tmp_path, db_url, port, processes=2)
    serve = await start_serve(node, listeners=2)
    with LoadClient(node.relay_port, "slow") as client:
        try:
            await state.wait_for(
                lambda: (
                    len(delivered_ids(state)) >= 10
                    and state.in_flight >= 1
                    and len(client.accepted) >= 30
                ),
                timeout=90,
            )
        finally:
            victims = [serve.proc.pid, *descendants(serve.proc.pid)]
            for pid in victims:  # stop them all first, so none reacts to another's death
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            serve.proc.wait(10)
        await wait_until(
            lambda: not any(alive(p) for p in victims), 30, "the killed processes did not go"
        )
    assert len(victims) >= 3, victims  # the supervisor and both workers
    at_kill = await status_counts(db_url)
    in_flight = at_kill.get("delivering", 0)
    accepted = client.accepted
    assert len(accepted) >= 30

    again = await start_serve(node, listeners=2)
    try:
        await wait_delivered(state, accepted, again, timeout=120)
        await wait_until(
            lambda: asyncio.run(status_counts(db_url)).keys() <= {"delivered"},
            60,
            "the queue did not drain",
        )
        assert_no_crash(again)
    finally:
        assert await stop_serve(again) == 0, again.output
    counts = delivered_ids(state)
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    print(  # the figures behind the assertion, for the log
        f"accepted={len(accepted)} delivering-at-kill={in_flight} duplicates={duplicates}"
        f" statuses-at-kill={at_kill}"
    )
    assert duplicates <= in_flight, (duplicates, at_kill)


@pytest.mark.slow
async def test_database_gone_during_load_gives_451_and_pigeon_recovers_by_itself(
    tmp_path: Path, db_url: str, admin_url: str, sink: tuple[SinkState, int]
) -> None:
    """Topology: a smtplib client thread --SMTP--> serve (1 process) --relayhost--> sink 127.0.0.2;
    serve --SQL--> this test's database on the shared PostgreSQL.

    "PostgreSQL restarted" without restarting the shared cluster: for this database only,
    `ALLOW_CONNECTIONS false` plus pg_terminate_backend of its sessions is what pigeon sees during a
    restart (every session cut, new connections refused), and allowing connections again is the
    server coming back. While it is down clients get 451 (no hang, no crash); within 10 s of its
    return a new message is accepted and delivered; everything that got 250 is delivered."""
    state, port = sink
    name = database_name(db_url)
    node = node_config(tmp_path, db_url, port, database='connect_timeout = "2s"')
    serve = await start_serve(node)
    try:
        with LoadClient(node.relay_port, "user") as client:
            await wait_until(lambda: len(client.accepted) >= 10, 60, "no mail accepted")
            await admin_execute(admin_url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
            await terminate_backends(admin_url, name)
            before = len(client.snapshot())
            await wait_until(
                lambda: sum(r.code == 451 for r in client.snapshot()[before:]) >= 5,
                60,
                "clients did not get 451 while the database was down",
            )
            await asyncio.sleep(2)
            down = client.snapshot()[before:]
            await admin_execute(admin_url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
            back = time.monotonic()
        # While down, every reply after the first cut sessions was a 451 (or a 250 for a message
        # that was committed just before the cut).
        assert {r.code for r in down} <= {250, 451}, [r for r in down if r.code not in (250, 451)]
        assert_no_crash(serve)

        fresh: str | None = None
        n = 0
        while time.monotonic() - back < 60 and fresh is None:
            n += 1
            reply = await asyncio.to_thread(
                send, node.relay_port, f"fresh+{n}@dest.test", f"fresh {n}"
            )
            fresh = reply.queue_id
            if fresh is None:
                await asyncio.sleep(0.2)
        accepted_at = time.monotonic() - back
        assert fresh is not None, serve.output
        await wait_delivered(state, [fresh], serve, timeout=60)
        delivered_at = time.monotonic() - back
        print(
            f"after the database's return: accepted in {accepted_at:.1f}s,"
            f" delivered in {delivered_at:.1f}s"
        )
        assert delivered_at <= 10, (accepted_at, delivered_at)
        await wait_delivered(state, client.accepted, serve, timeout=90)
        assert_no_crash(serve)
    finally:
        await admin_execute(admin_url, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        assert await stop_serve(serve) == 0, serve.output


async def test_a_sink_that_hangs_after_data_is_timed_out_deferred_and_retried(
    tmp_path: Path, db_url: str, sink: tuple[SinkState, int]
) -> None:
    """Topology: smtplib --SMTP--> serve (1 process) --relayhost--> sink 127.0.0.2 that reads the
    first message for `hang-data+1@dest.test` and never answers its final dot (later attempts are
    accepted). With delivery.data_timeout = 2s the attempt times out, the recipient is deferred
    (an attempt row says so), and the retry delivers it."""
    state, port = sink
    node = node_config(tmp_path, db_url, port, delivery='data_timeout = "2s"')
    serve = await start_serve(node)
    try:
        reply = await asyncio.to_thread(send, node.relay_port, "hang-data+1@dest.test", "hang")
        assert reply.queue_id, reply
        await wait_delivered(state, [reply.queue_id], serve, timeout=60)
        await wait_until(
            lambda: asyncio.run(status_counts(db_url)) == {"delivered": 1},
            30,
            "the recipient was not marked delivered",
        )
        assert_no_crash(serve)
    finally:
        assert await stop_serve(serve) == 0, serve.output
    attempts = await fetch(db_url, "SELECT outcome, code, response FROM attempt ORDER BY attempt")
    assert [a["outcome"] for a in attempts] == ["deferred", "delivered"], attempts
    assert "timed out" in attempts[0]["response"].lower(), attempts
    assert [m.replied for m in state.received_by("hang-data+1@dest.test")] == [False, True]


@pytest.mark.slow
async def test_read_only_database_gives_451_without_crash_and_recovers_when_writable(
    tmp_path: Path, db_url: str, admin_url: str, sink: tuple[SinkState, int]
) -> None:
    """Topology: smtplib --SMTP--> serve (1 process) --relayhost--> sink 127.0.0.2; serve --SQL-->
    this test's database. `default_transaction_read_only = on` is set on the database and its
    sessions are cut so new ones pick it up: a client gets 451 and serve keeps running (engine
    included). Set back (sessions cut again), mail is accepted and delivered."""
    state, port = sink
    name = database_name(db_url)
    node = node_config(tmp_path, db_url, port)
    serve = await start_serve(node)
    try:
        first = await asyncio.to_thread(send, node.relay_port, "user+1@dest.test", "before")
        assert first.queue_id, first
        await admin_execute(
            admin_url, f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'
        )
        await terminate_backends(admin_url, name)
        refused = [
            await asyncio.to_thread(send, node.relay_port, f"user+{n}@dest.test", "read-only")
            for n in range(2, 5)
        ]
        assert [r.code for r in refused] == [451] * 3, refused
        await asyncio.sleep(2)  # the engine and sweeper meet the read-only database too
        assert_no_crash(serve)

        await admin_execute(
            admin_url, f'ALTER DATABASE "{name}" RESET default_transaction_read_only'
        )
        await terminate_backends(admin_url, name)
        later: Reply | None = None
        for n in range(5, 200):
            later = await asyncio.to_thread(send, node.relay_port, f"user+{n}@dest.test", "after")
            if later.queue_id:
                break
            await asyncio.sleep(0.2)
        assert later is not None and later.queue_id, later
        await wait_delivered(state, [first.queue_id, later.queue_id], serve, timeout=60)
        assert_no_crash(serve)
    finally:
        await admin_execute(
            admin_url, f'ALTER DATABASE "{name}" RESET default_transaction_read_only'
        )
        assert await stop_serve(serve) == 0, serve.output


@contextlib.contextmanager
def open_files(wanted: int) -> Iterator[None]:
    """Raise this process's open-file limit (serve, started inside, inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
async def test_1000_idle_connections_a_new_client_is_served_and_the_per_ip_limit_holds(
    tmp_path: Path, db_url: str, sink: tuple[SinkState, int]
) -> None:
    """Topology: 1,000 raw TCP connections from 127.0.0.10 .. 127.0.0.59 (20 each), idle after the
    greeting --> serve (1 process, limits.max_connections_per_ip = 20) --relayhost--> sink
    127.0.0.2. Each of the 1,000 is greeted with 220; a 21st connection from 127.0.0.10 gets 421;
    a new client from 127.0.0.200 is greeted and its message accepted and delivered."""
    state, port = sink
    sources = [f"127.0.0.{i}" for i in range(10, 60)]
    with open_files(8192):
        node = node_config(tmp_path, db_url, port, limits="max_connections_per_ip = 20")
        serve = await start_serve(node)
        writers: list[asyncio.StreamWriter] = []
        gate = asyncio.Semaphore(100)

        async def idle(source: str) -> bytes:
            async with gate:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", node.relay_port, local_addr=(source, 0)
                )
                writers.append(writer)
                return await asyncio.wait_for(reader.readline(), 60)

        try:
            greetings = await asyncio.gather(*(idle(s) for s in sources for _ in range(20)))
            assert len(greetings) == 1000
            assert all(g.startswith(b"220 ") for g in greetings), collections.Counter(
                g[:3] for g in greetings
            )

            reader, writer = await asyncio.open_connection(
                "127.0.0.1", node.relay_port, local_addr=(sources[0], 0)
            )
            writers.append(writer)
            refusal = await asyncio.wait_for(reader.readline(), 60)
            assert refusal.startswith(b"421 "), refusal

            reply = await asyncio.to_thread(
                send, node.relay_port, "user+new@dest.test", "new client", "127.0.0.200"
            )
            assert reply.queue_id, reply
            await wait_delivered(state, [reply.queue_id], serve, timeout=60)
            assert_no_crash(serve)
        finally:
            for writer in writers:
                writer.close()
            for writer in writers:
                with contextlib.suppress(OSError, ConnectionError):
                    await writer.wait_closed()
            assert await stop_serve(serve) == 0, serve.output
