"""Node identity against the real `pigeon-mta serve`: one live run per node name and per data_dir.

    smtplib (test) --SMTP--> relay listener of serve A (node "twin", data_dir a/)
        serve A --SMTP (relayhost)--> sink 127.0.0.2 (the reply to the final dot waits until
                                      the test releases it)
    serve B: the same node name from another data_dir (another host), or the same data_dir
        serve A, serve B --SQL--> PostgreSQL (this test's own database)

Each test holds one message mid-DATA at the sink under A's lease, then starts B: B must not free
that lease, or the sink gets the message twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import smtplib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.node import STALE_AFTER
from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, descendants, write_config
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

RECIPIENT = "held@dest.test"


@pytest.fixture
async def sink() -> AsyncIterator[tuple[SinkState, int]]:
    state = SinkState()
    server = await start_sink(state, "127.0.0.2")
    try:
        yield state, server.sockets[0].getsockname()[1]
    finally:
        await stop_servers([server])


def node_config(directory: Path, db_url: str, sink_port: int, *, processes: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_config(
        directory,
        f"""
[server]
node_name = "twin"
hostname = "twin.test"
data_dir = "{directory}"
processes = {processes}
shutdown_timeout = "3s"
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{free_port()}"
mode = "relay"
[metrics]
listen = "127.0.0.1:{free_port()}"
[log]
delivery_log = ""
[delivery]
relayhost = "127.0.0.2:{sink_port}"
relayhost_tls = "none"
lease = "10m"
poll_interval = "200ms"
""",
    )


def relay_port(config: Path) -> int:
    text = config.read_text()
    return int(text.split('address = "127.0.0.1:', 1)[1].split('"', 1)[0])


async def start(config: Path, *, ready: str = "listener relay bound on") -> ServeProcess:
    serve = ServeProcess("--config", str(config))
    await asyncio.to_thread(serve.wait_for, ready, 60)
    return serve


def send(port: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.sendmail(
            "app@host.internal", [RECIPIENT], b"Subject: once\r\n\r\nexactly once, please\r\n"
        )


async def mid_data(config: Path, state: SinkState, pool: asyncpg.Pool) -> str:
    """Queue the message through the node of `config`; returns its lease owner once the node's
    final dot waits at the sink."""
    await asyncio.to_thread(send, relay_port(config))
    await state.wait_for(lambda: state.in_flight >= 1, 60)
    owner = await pool.fetchval("SELECT lease_owner FROM recipient WHERE status = 'delivering'")
    assert isinstance(owner, str)
    return owner


async def refused(serve: ServeProcess) -> int:
    try:
        return await asyncio.to_thread(serve.proc.wait, 60)
    finally:
        serve.stop()


async def lease(pool: asyncpg.Pool) -> tuple[str, str | None]:
    row = await pool.fetchrow("SELECT status, lease_owner FROM recipient")
    assert row is not None
    return row["status"], row["lease_owner"]


async def delivered(pool: asyncpg.Pool, state: SinkState) -> None:
    await state.wait_for(lambda: len(state.messages) >= 1, 60)
    deadline = time.monotonic() + 60
    while (await lease(pool))[0] != "delivered":
        assert time.monotonic() < deadline, await lease(pool)
        await asyncio.sleep(0.2)


async def refused_without_touching_the_claim(
    second: ServeProcess, pool: asyncpg.Pool, state: SinkState
) -> None:
    """`second` started while the first node's claim waits at the sink exits 1; the sink then
    answers, and the message is delivered once, by that claim."""
    assert await refused(second) == 1, second.output
    state.release.set()
    await delivered(pool, state)
    assert state.deliveries() == {RECIPIENT: 1}
    # One claim, never freed: a freed lease leaves a 'deferred' attempt and a second claim.
    assert await pool.fetchval("SELECT attempts FROM recipient") == 1
    assert await pool.fetchval("SELECT count(*) FROM attempt WHERE outcome = 'deferred'") == 0


async def test_a_second_node_with_the_name_of_a_live_node_is_refused_and_frees_nothing(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, sink: tuple[SinkState, int]
) -> None:
    state, port = sink
    first = await start(node_config(tmp_path / "a", db_url, port))
    try:
        owner = await mid_data(tmp_path / "a" / "pigeon.toml", state, pool)
        second = ServeProcess("--config", str(node_config(tmp_path / "b", db_url, port)))
        await refused_without_touching_the_claim(second, pool, state)
        assert "pigeon-mta: node name 'twin' is in use by a live node (host " in second.output
        assert "give each node its own 'server.node_name'" in second.output
        # The lease named the run (`queue show` prints it).
        assert owner.startswith("twin/") and len(owner) > len("twin/")
    finally:
        assert await asyncio.to_thread(first.stop) == 0, first.output
    # A clean stop gives the name up: the other host's node starts at once.
    again = await start(tmp_path / "b" / "pigeon.toml")
    assert await asyncio.to_thread(again.stop) == 0, again.output


async def test_after_kill_9_the_name_is_taken_once_the_heartbeat_is_stale_and_leases_freed(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, sink: tuple[SinkState, int]
) -> None:
    state, port = sink
    first = await start(node_config(tmp_path / "a", db_url, port))
    try:
        owner = await mid_data(tmp_path / "a" / "pigeon.toml", state, pool)
    finally:
        first.kill()
    state.release.set()  # the next claim is answered at once
    other_host = node_config(tmp_path / "b", db_url, port)
    # From another host a fresh heartbeat is all there is to go by: A may still be alive.
    early = ServeProcess("--config", str(other_host))
    assert await refused(early) == 1, early.output
    assert "is in use by a live node" in early.output
    assert await lease(pool) == ("delivering", owner)

    # The bound passes with no heartbeat (moved back rather than waited for).
    await pool.execute(
        "UPDATE node SET heartbeat_at = heartbeat_at - make_interval(secs => $1)", STALE_AFTER
    )
    second = await start(other_host)
    try:
        second.wait_for("freed 1 recipient(s) that node twin held when it last stopped")
        await delivered(pool, state)
    finally:
        assert await asyncio.to_thread(second.stop) == 0, second.output
    lost = await pool.fetchval("SELECT response FROM attempt WHERE outcome = 'deferred'")
    assert lost.startswith(f"lease of {owner} ended before its attempt was recorded")


async def test_a_restart_on_the_same_data_dir_after_kill_9_starts_at_once_and_frees_leases(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, sink: tuple[SinkState, int]
) -> None:
    """The data_dir lock the new start holds proves the killed run gone, heartbeat or not."""
    state, port = sink
    config = node_config(tmp_path / "a", db_url, port)
    first = await start(config)
    try:
        owner = await mid_data(config, state, pool)
    finally:
        first.kill()
    state.release.set()  # the next claim is answered at once
    again = await start(config)
    try:
        again.wait_for("freed 1 recipient(s) that node twin held when it last stopped")
        await delivered(pool, state)
        assert (await lease(pool))[1] is None
    finally:
        assert await asyncio.to_thread(again.stop) == 0, again.output
    assert f"as run {owner};" not in again.output  # a run of its own


async def test_a_second_serve_on_the_same_data_dir_is_refused_and_frees_nothing(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, sink: tuple[SinkState, int]
) -> None:
    state, port = sink
    config = node_config(tmp_path / "a", db_url, port)
    first = await start(config)
    try:
        await mid_data(config, state, pool)
        second = ServeProcess("--config", str(config))
        await refused_without_touching_the_claim(second, pool, state)
        assert (
            f"pigeon-mta: another pigeon-mta serve (pid {first.proc.pid}) is already running "
            f"with data_dir {tmp_path / 'a'}"
        ) in second.output
    finally:
        assert await asyncio.to_thread(first.stop) == 0, first.output


async def test_worker_processes_exit_when_their_supervisor_is_killed(
    tmp_path: Path, db_url: str, sink: tuple[SinkState, int]
) -> None:
    """A worker left behind would deliver under leases that the node's next start frees."""
    _state, port = sink
    serve = ServeProcess("--config", str(node_config(tmp_path, db_url, port, processes=2)))
    workers: list[int] = []
    try:
        await asyncio.to_thread(serve.wait_for, "worker 0 ready", 60)
        await asyncio.to_thread(serve.wait_for, "worker 1 ready", 60)
        workers = descendants(serve.proc.pid)
        assert len(workers) >= 2
        os.kill(serve.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(serve.proc.wait, 10)
        deadline = time.monotonic() + 30
        while alive := [pid for pid in workers if running(pid)]:
            assert time.monotonic() < deadline, f"outlived their supervisor: {alive}"
            await asyncio.sleep(0.1)
    finally:
        serve.kill()
        for pid in workers:  # orphans are no longer below the supervisor
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, not by this test)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
