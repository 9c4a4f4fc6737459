"""The database goes away under the running API: requests get 503 with Retry-After and nothing is
queued; once it is back, the API serves again by itself. A commit whose answer is lost, or whose
client hung up while it waited, is not queued again by a repeat with the same Idempotency-Key.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ──X── PostgreSQL (connections refused)
                                      └─ group commit ──► CommitCutter (loopback) ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest

from pigeon_mta.api.problems import TYPE_PREFIX
from pigeon_mta.config import Duration, Settings
from pigeon_mta.store import connect as store_connect
from tests.integration.api_helpers import running_api
from tests.peers.pg_relay import CommitCutter


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


async def test_a_repeat_after_a_lost_commit_answer_queues_nothing_and_answers_202(
    pool: asyncpg.Pool, db_url: str
) -> None:
    """The message of a request with an Idempotency-Key is committed, but the connection breaks
    before pigeon hears so: the request gets 503. Its repeats answer 202 with that message, and
    the message is queued once."""
    parts = urlsplit(db_url)
    assert parts.hostname is not None, "the relay needs PostgreSQL on TCP"
    cutter = CommitCutter(parts.hostname, parts.port or 5432)
    port = await cutter.start()
    user = parts.netloc.rpartition("@")[0]
    relayed = urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}", query="sslmode=disable"))
    commit_pool = await store_connect.commit_pool(relayed, Settings())
    message = {"from": "shop@acme.example", "to": "ann@dest.example", "text": "once"}
    try:
        async with (
            running_api(pool, commit_pool=commit_pool) as api,
            aiohttp.ClientSession() as session,
        ):
            headers = {"Authorization": f"Bearer {api.key}"}

            async def send(**extra: str) -> tuple[int, bytes]:
                async with session.post(
                    api.url + "/v1/messages", json=message, headers=headers | extra
                ) as answer:
                    return answer.status, await answer.read()

            # A first message prepares the enqueue on the commit connection: the next command
            # the relay sees completing there is the enqueue of the keyed request.
            status, body = await send()
            assert status == 202, body
            first = uuid.UUID(json.loads(body)["queue_id"])

            cutter.cut_next_commit()
            status, body = await send(**{"Idempotency-Key": "lost-1"})
            assert cutter.cut.is_set()
            assert status == 503, body
            # The message is queued, so the answer must not say it is not.
            detail = json.loads(body)["detail"]
            assert "may not be queued" in detail and "same Idempotency-Key" in detail, detail
            [lost] = await pool.fetch("SELECT id FROM message WHERE id <> $1", first)

            repeats = [await send(**{"Idempotency-Key": "lost-1"}) for _ in range(3)]
            assert len(set(repeats)) == 1 and repeats[0][0] == 202, repeats
            assert json.loads(repeats[0][1])["queue_id"] == str(lost["id"])
            assert await pool.fetchval("SELECT count(*) FROM message") == 2
    finally:
        await commit_pool.close()
        await cutter.stop()


async def test_a_send_that_meets_the_outage_in_the_intake_is_logged_once(
    pool: asyncpg.Pool, admin_url: str, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The key and the sender domain remembered (api.auth_cache), the outage is met by the
    intake's rate check: one log line says so (the intake's, with the submitter), not one from
    the intake and another from the API's answer."""
    settings = Settings()
    settings = dataclasses.replace(
        settings,
        api=dataclasses.replace(settings.api, auth_cache=Duration(60)),
        limits=dataclasses.replace(settings.limits, credential_rate_limit=1000),
    )
    message = {"from": "shop@acme.example", "to": "ann@dest.example", "text": "hi"}
    async with running_api(pool, settings) as api, aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {api.key}"}
        async with session.post(api.url + "/v1/messages", json=message, headers=headers) as ok:
            assert ok.status == 202, await ok.text()
        caplog.clear()
        caplog.set_level(logging.INFO)
        await set_reachable(admin_url, db_url, False)
        try:
            async with session.post(
                api.url + "/v1/messages", json=message, headers=headers
            ) as answer:
                assert answer.status == 503, await answer.text()
        finally:
            await set_reachable(admin_url, db_url, True)
    trouble = [r.getMessage() for r in caplog.records if "database trouble" in r.getMessage()]
    assert len(trouble) == 1, trouble
    assert f"apikey:{api.key_id}" in trouble[0]


async def test_a_client_gone_mid_commit_and_its_repeat_queue_the_message_once(
    pool: asyncpg.Pool, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The commit of a keyed request waits on a lock; its client gives up and hangs up, and sends
    the request again while the first commit still waits. Once the lock is gone both commits end:
    the message is queued once, under the queue id the key claimed, and every answer names it."""
    message = {"from": "shop@acme.example", "to": ["ann@dest.example", "bob@dest.example"]}
    message["text"] = "once, whatever the client does"
    caplog.set_level(logging.INFO)
    async with running_api(pool) as api:
        headers = {"Authorization": f"Bearer {api.key}", "Idempotency-Key": "gone-1"}
        blocker = await asyncpg.connect(db_url)
        try:
            lock = blocker.transaction()
            await lock.start()
            # The enqueue's foreign-key check on the org row waits while this holds it.
            await blocker.execute("SELECT * FROM org WHERE name = 'acme' FOR UPDATE")

            async def waiting_on_the_lock(count: int) -> bool:
                for _ in range(500):  # bounded: 10 s
                    waiting = await blocker.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'"
                    )
                    if waiting >= count:
                        return True
                    await asyncio.sleep(0.02)
                return False

            # The first request: the client hangs up while its commit waits.
            gone = aiohttp.ClientSession()
            first = asyncio.create_task(
                gone.post(api.url + "/v1/messages", json=message, headers=headers)
            )
            assert await waiting_on_the_lock(1), "the first commit never waited on the lock"
            first.cancel()
            await gone.close()
            # The repeat, on a new connection, while the first commit still waits.
            async with aiohttp.ClientSession() as session:
                repeat = asyncio.create_task(
                    session.post(api.url + "/v1/messages", json=message, headers=headers)
                )
                await asyncio.sleep(0.3)
                assert not repeat.done()
                await lock.rollback()
                answer = await asyncio.wait_for(repeat, 30)
                assert answer.status == 202, await answer.text()
                repeated = json.loads(await answer.read())
                # And once more, after both: the answer the key keeps.
                async with session.post(
                    api.url + "/v1/messages", json=message, headers=headers
                ) as again:
                    assert again.status == 202, await again.text()
                    kept = json.loads(await again.read())
        finally:
            await blocker.close()
    rows = await pool.fetch("SELECT id FROM message")
    assert [str(r["id"]) for r in rows] == [repeated["queue_id"]]
    assert kept["queue_id"] == repeated["queue_id"]
    recipients = await pool.fetch(
        "SELECT id, address FROM recipient WHERE message_id = $1 ORDER BY address", rows[0]["id"]
    )
    assert [r["address"] for r in recipients] == ["ann@dest.example", "bob@dest.example"]
    expected = [{"address": r["address"], "id": str(r["id"])} for r in recipients]
    assert repeated["recipients"] == expected and kept["recipients"] == expected
    # One of the two commits found the other's message under the claimed queue id.
    repeats = [r for r in caplog.records if "was queued by a repeat of its submission" in r.message]
    assert len(repeats) == 1, [r.message for r in caplog.records]
