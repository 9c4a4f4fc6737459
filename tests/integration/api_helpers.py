"""The HTTP API of one process on loopback, for the API tests: the real aiohttp application and
group commit on a real PostgreSQL database, with two orgs, their sender domains and keys.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ── GroupCommit ── PostgreSQL
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg

from pigeon_mta.api.server import ApiService
from pigeon_mta.config import HostPort, Settings
from pigeon_mta.intake.accept import Intake
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from tests.conftest import free_port


@dataclass
class Api:
    url: str  # http://127.0.0.1:port (https with [api] tls_cert)
    key: str  # a key of acme, which owns acme.example
    key_id: uuid.UUID
    other_key: str  # a key of other, which owns other.example
    revoked_key: str  # a revoked key of acme
    acme: uuid.UUID
    queued: list[int]  # the group commit's wake-ups: recipients queued by each commit


@asynccontextmanager
async def running_api(
    pool: asyncpg.Pool, settings: Settings | None = None, *, commit_pool: asyncpg.Pool | None = None
) -> AsyncIterator[Api]:
    """The API on `pool`; its group commit on `commit_pool` when given (as a worker's has a pool
    of its own, store/connect.py)."""
    settings = settings or Settings()
    settings = dataclasses.replace(
        settings, api=dataclasses.replace(settings.api, listen=HostPort("127.0.0.1", free_port()))
    )
    acme = await store_orgs.ensure_org(pool, "acme")
    other = await store_orgs.ensure_org(pool, "other")
    await store_domains.add_sender_domain(pool, acme, "acme.example")
    await store_domains.add_sender_domain(pool, other, "other.example")
    key_row, key = await store_apikeys.add_api_key(pool, acme, name="app")
    _other_row, other_key = await store_apikeys.add_api_key(pool, other)
    revoked_row, revoked_key = await store_apikeys.add_api_key(pool, acme)
    await store_apikeys.revoke_api_key(pool, revoked_row.id)
    queued: list[int] = []
    intake = Intake.of(settings, pool, commit_pool=commit_pool, on_queued=queued.append)
    service = ApiService(settings, pool, intake)
    await service.start()
    try:
        scheme = "https" if settings.api.tls_cert else "http"
        yield Api(
            f"{scheme}://127.0.0.1:{service.server.port}",
            key,
            key_row.id,
            other_key,
            revoked_key,
            acme,
            queued,
        )
    finally:
        await service.stop(0)
