"""The database goes away under the running API: requests get 503 with Retry-After and nothing is
queued; once it is back, the API serves again by itself.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ──X── PostgreSQL (connections refused)
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import aiohttp
import asyncpg

from pigeon_mta.api.problems import TYPE_PREFIX
from tests.integration.api_helpers import running_api


async def set_reachable(admin_url: str, db_url: str, reachable: bool) -> None:
    """Refuse new connections to the test database and end the open ones (or allow them again)."""
    name = urlsplit(db_url).path.lstrip("/")
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(
            f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {"true" if reachable else "false"}'
        )
        if not reachable:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
            )
    finally:
        await admin.close()


async def test_503_with_retry_after_while_the_database_is_away_then_recovery(
    pool: asyncpg.Pool, admin_url: str, db_url: str
) -> None:
    message = {"from": "shop@acme.example", "to": "ann@dest.example", "text": "hi"}
    async with running_api(pool) as api, aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {api.key}"}
        await set_reachable(admin_url, db_url, False)
        try:
            for idempotency_key in (None, "outage-1"):
                sent = headers | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
                async with session.post(
                    api.url + "/v1/messages", json=message, headers=sent
                ) as answer:
                    assert answer.status == 503, await answer.text()
                    assert int(answer.headers["Retry-After"]) > 0
                    problem = json.loads(await answer.read())
                    assert problem["type"] == TYPE_PREFIX + "database-unavailable"
        finally:
            await set_reachable(admin_url, db_url, True)
        assert await pool.fetchval("SELECT count(*) FROM message") == 0
        async with session.post(
            api.url + "/v1/messages",
            json=message,
            headers=headers | {"Idempotency-Key": "outage-1"},
        ) as answer:
            assert answer.status == 202, await answer.text()
        assert await pool.fetchval("SELECT count(*) FROM message") == 1


async def test_the_reading_routes_answer_503_while_the_database_is_away(
    pool: asyncpg.Pool, admin_url: str, db_url: str
) -> None:
    async with running_api(pool) as api, aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {api.key}"}
        routes = [
            ("GET", "/v1/messages"),
            ("GET", "/v1/messages/01900000-0000-7000-8000-000000000000"),
            ("GET", "/v1/suppressions"),
            ("GET", "/v1/suppressions/ann@dest.example"),
            ("DELETE", "/v1/suppressions/ann@dest.example"),
        ]
        await set_reachable(admin_url, db_url, False)
        try:
            for method, path in routes:
                async with session.request(method, api.url + path, headers=headers) as answer:
                    assert answer.status == 503, (path, await answer.text())
                    assert int(answer.headers["Retry-After"]) > 0
        finally:
            await set_reachable(admin_url, db_url, True)
        async with session.get(api.url + "/v1/messages", headers=headers) as answer:
            assert answer.status == 200, await answer.text()
