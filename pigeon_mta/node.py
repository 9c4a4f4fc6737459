"""This node's run of `serve`: the data_dir lock, the run's identity and its heartbeat.

A run is one start of `serve`: the supervisor and its worker processes. They share one run id and
write `<node_name>/<run_id>` as the owner of the leases they take, so that a lease names the run
that holds it. The run is alive while its supervisor is: the supervisor holds the data_dir lock and
writes the heartbeat, and each worker process exits as soon as its supervisor is gone (a worker
left behind would go on delivering under leases that the node's next start frees).

At start the run takes its node name in the database (store/nodes.py). It is refused while another
run holds the name and is alive: that is two nodes configured with one name, and if both ran, each
would free the other's leases at its start and deliver the same messages twice. A run is gone when
it stopped cleanly (it marks its row), when its heartbeat is older than STALE_AFTER, or when it is
the run that last held this data_dir's lock (holding the lock proves its supervisor has exited, so
a node restarted after kill -9 or a crash starts at once).

The heartbeat is written every HEARTBEAT_INTERVAL; STALE_AFTER is six intervals. A live supervisor
misses six beats in a row only when it cannot reach the database for that long (each beat is one
short UPDATE, and the supervisor's event loop does no heavy work); a run that is judged gone and
comes back finds its row taken over and stops. Leases are not freed earlier than that bound on
another host's word; the lease sweeper's expiry (`delivery.lease`) is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import multiprocessing
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from pigeon_mta.store import nodes as store_nodes
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger("pigeon_mta.serve")

HEARTBEAT_INTERVAL = 5.0
STALE_AFTER = 6 * HEARTBEAT_INTERVAL
LOCK_FILE = "serve.lock"


class ServeRefused(Exception):
    """`serve` must not start (another one runs on this data_dir or under this node name); the
    message is one sentence for the operator."""


@dataclass(frozen=True)
class NodeRun:
    name: str
    run_id: str = field(default_factory=lambda: secrets.token_hex(6))

    @property
    def lease_owner(self) -> str:
        return f"{self.name}/{self.run_id}"


# ---------------------------------------------------------------- data_dir lock


@dataclass
class DataDirLock:
    path: Path
    fd: int
    # The run that held this lock before (read from the file): it is gone, since the lock is ours.
    previous_run: str

    def record(self, run: NodeRun) -> None:
        """Write who holds the lock: the PID for a refused second start, the run for the next."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()} {run.run_id}\n".encode(), 0)

    def release(self) -> None:
        os.close(self.fd)


@contextlib.contextmanager
def data_dir_lock(data_dir: str) -> Iterator[DataDirLock]:
    """An exclusive lock on `data_dir/serve.lock`, held while the block runs. The kernel drops it
    when the process dies, however it dies. Two `serve` on one data_dir would share the listening
    ports through SO_REUSEPORT, the embedded database and the certificates without either noticing."""
    directory = Path(data_dir).expanduser()
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    except OSError as exc:
        raise ServeRefused(
            f"cannot lock 'server.data_dir' {directory}: {exc.strerror or exc}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_lock(fd)[0]
        os.close(fd)
        who = f" (pid {holder})" if holder else ""
        raise ServeRefused(
            f"another pigeon-mta serve{who} is already running with data_dir {directory}"
        ) from None
    lock = DataDirLock(path, fd, previous_run=_read_lock(fd)[1])
    try:
        yield lock
    finally:
        lock.release()


def _read_lock(fd: int) -> tuple[str, str]:
    """(pid, run id) as the lock file records them; empty where it does not."""
    pid, run_id, *_ = [*os.pread(fd, 200, 0).decode("ascii", "replace").split(), "", ""]
    return pid, run_id


# ---------------------------------------------------------------- the run in the database


async def take_node_name(conn: asyncpg.Connection, run: NodeRun, lock: DataDirLock) -> None:
    """Make `run` the live run of its node name, or refuse the start."""
    holder = await store_nodes.take_node_name(
        conn,
        name=run.name,
        run_id=run.run_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        stale_after=STALE_AFTER,
        known_dead_run=lock.previous_run,
    )
    if holder is not None:
        raise ServeRefused(
            f"node name {run.name!r} is in use by a live node (host {holder.host}, pid "
            f"{holder.pid}, last heartbeat {holder.heartbeat_age:.0f}s ago): give each node its "
            f"own 'server.node_name'"
        )


class Heartbeat:
    """The run's heartbeat, written by the supervisor from `start` to `close` (after the drain,
    so that a node draining for longer than STALE_AFTER still holds its name)."""

    def __init__(self, pool: asyncpg.Pool, run: NodeRun, on_displaced: asyncio.Event) -> None:
        self.pool = pool
        self.run = run
        self.on_displaced = on_displaced
        # Another run took the name over: the node stops (on_displaced), and exits non-zero.
        self.displaced = False
        # Cleared when the drain left work running: then the row is not marked stopped.
        self.clean_stop = True
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat_loop(), name="heartbeat")

    async def close(self) -> None:
        self._done.set()
        if self._task is not None:
            await self._task
        if self.clean_stop and not self.displaced:
            try:
                await store_nodes.mark_stopped(
                    self.pool, name=self.run.name, run_id=self.run.run_id
                )
            except DB_ERRORS as exc:
                log.warning("node run not marked stopped: %s", exc)

    async def _beat_loop(self) -> None:
        reachable = True
        while not self._done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), HEARTBEAT_INTERVAL)
            if self._done.is_set():
                return
            try:
                alive = await asyncio.wait_for(
                    store_nodes.beat(self.pool, name=self.run.name, run_id=self.run.run_id),
                    HEARTBEAT_INTERVAL,
                )
            except DB_ERRORS as exc:  # TimeoutError is an OSError
                if reachable:
                    log.warning("heartbeat: cannot reach the database: %s", exc)
                reachable = False
                continue
            reachable = True
            if not alive:
                log.error(
                    "node name %r was taken over by another run while this one could not write "
                    "its heartbeat for %gs: stopping",
                    self.run.name,
                    STALE_AFTER,
                )
                self.displaced = True
                self.on_displaced.set()
                return


# ---------------------------------------------------------------- worker processes


def exit_with_supervisor(loop: asyncio.AbstractEventLoop) -> None:
    """In a worker process: exit at once, as a kill -9 would, when the supervisor is gone. The
    run's liveness is its supervisor's (the data_dir lock, the heartbeat)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    loop.add_reader(parent.sentinel, _supervisor_gone)


def _supervisor_gone() -> None:
    log.error("the supervisor is gone: this worker exits at once")
    os._exit(1)
