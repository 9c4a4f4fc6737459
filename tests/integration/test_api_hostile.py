"""The HTTP API against hostile clients: no key, wrong keys, oversized requests and values the
database cannot store, each refused with its status for the price of reading it, and nothing
queued.

raw socket / aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ── PostgreSQL
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import email
import json
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import pytest

from pigeon_mta.api import problems
from pigeon_mta.api.problems import TYPE_PREFIX
from pigeon_mta.config import Duration, LimitsSettings, Settings
from tests.integration.api_helpers import Api, running_api
from tests.integration.test_api_requests import GOOD, post

BIG = 45 * 1024 * 1024
OTHER = {**GOOD, "from": "Shop <shop@other.example>"}


@pytest.fixture
async def api(pool: asyncpg.Pool) -> AsyncIterator[Api]:
    async with running_api(pool) as api:
        yield api


async def _head_only(api: Api, head: str) -> tuple[bytes, bool]:
    """Send a request's head and none of its body; the answer that comes without the body, and
    whether the server then closed the connection."""
    parts = urlsplit(api.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head.encode("latin-1"))
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(
            next(
                line.split(b":", 1)[1]
                for line in answer.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
        )
        answer += await asyncio.wait_for(reader.readexactly(length), 10)
        closed = await asyncio.wait_for(reader.read(1), 10) == b""
        return answer, closed
    finally:
        writer.close()


@pytest.mark.parametrize(
    "authorization",
    ["", "Authorization: Bearer pk_wrong_key_0123456789\r\n", "Authorization: Basic eDp5\r\n"],
    ids=["no-key", "wrong-key", "not-bearer"],
)
async def test_a_body_without_a_valid_key_is_never_read(
    api: Api, pool: asyncpg.Pool, authorization: str
) -> None:
    """401 as soon as the head is in, the 45 MB body unsent, and the connection closed: the
    worker holds none of it (four such POSTs grew a worker by 213 MB when the body came first)."""
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {BIG}\r\n{authorization}\r\n"
    )
    answers = await asyncio.gather(*(_head_only(api, head) for _ in range(4)))
    for answer, closed in answers:
        assert answer.startswith(b"HTTP/1.1 401 ")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["type"] == TYPE_PREFIX + "unauthorized"
        assert closed
    assert await pool.fetchval("SELECT count(*) FROM message") == 0


async def test_bodies_beyond_the_process_room_wait_then_get_503(pool: asyncpg.Pool) -> None:
    """With room for one body at a time, a request waits for the room for up to read_timeout:
    B, which comes while A holds it, gets it once A's body times out; C, which comes while B
    holds it and waits longer than read_timeout, is answered 503 with Retry-After, unread.

        A  |holds 0-3 s, 408|
        B     waits 1-3 s  |holds 3-6 s, 408|
        C          waits 2-5 s: 503
    """
    settings = Settings(limits=LimitsSettings(max_message_size=100_000))
    settings = dataclasses.replace(
        settings,
        api=dataclasses.replace(settings.api, max_body_memory=1, read_timeout=Duration(3)),
    )
    async with running_api(pool, settings) as api:
        head = (
            f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {api.key}\r\nContent-Length: 1000000\r\n\r\n"
        )
        a = asyncio.create_task(_head_only(api, head))
        await asyncio.sleep(1)
        b = asyncio.create_task(_head_only(api, head))
        await asyncio.sleep(1)
        c, closed = await _head_only(api, head)
        assert c.startswith(b"HTTP/1.1 503 ") and closed
        assert b"Retry-After: 1" in c
        assert json.loads(c.split(b"\r\n\r\n", 1)[1])["type"] == TYPE_PREFIX + "busy"
        for waited in (a, b):
            answer, _closed = await waited
            assert answer.startswith(b"HTTP/1.1 408 ")
        # The room is free again: a request that sends its body is queued.
        assert (await post(api, GOOD))[0] == 202


async def test_wrong_keys_are_throttled_per_address_and_logged_once(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(limits=LimitsSettings(max_auth_failures=5))
    caplog.set_level(logging.INFO, logger="pigeon_mta.api")
    async with running_api(pool, settings) as api:
        # A client of the same address (behind one proxy) whose key this process has found.
        assert (await post(api, OTHER, key="other"))[0] == 202
        statuses = []
        for i in range(30):
            status, headers, body = await post(api, GOOD, key=f"pk_guess_{i:04d}")
            statuses.append(status)
        assert statuses == [401] * 5 + [429] * 25
        assert int(headers["Retry-After"]) > 500  # the rest of limits.auth_failure_window
        assert json.loads(body)["type"] == TYPE_PREFIX + "too-many-key-failures"
        # The address is refused before its key is looked at: a right key too, as SMTP AUTH,
        # unless this process found that key valid within the window.
        assert (await post(api, GOOD))[0] == 429
        assert (await post(api, OTHER, key="other"))[0] == 202
    # Counted where SMTP AUTH failures are, once each until the limit was passed, then no more.
    rows = await pool.fetch("SELECT listener FROM auth_failure")
    assert [r["listener"] for r in rows] == ["api"] * 6
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unknown or revoked key" in m for m in messages) == 1
    assert sum("throttled" in m for m in messages) == 1
    assert await pool.fetchval("SELECT count(*) FROM message") == 2


@pytest.mark.parametrize(
    ("request_", "status", "kind"),
    [
        (
            # Counted before any is parsed: the bad last one is never read.
            {**GOOD, "to": [f"r{i}@dest.example" for i in range(200_000)] + ["not an address"]},
            422,
            "too-many-recipients",
        ),
        ({**GOOD, "headers": {f"X-H{i}": "v" * 40 for i in range(20_000)}}, 422, "invalid-header"),
        ({**GOOD, "subject": "word " * 200_000}, 422, "invalid-header"),
        ({**GOOD, "headers": {"X-Big": "v" * 20_000}}, 422, "invalid-header"),
        ({**GOOD, "reply_to": [f"r{i}@dest.example" for i in range(20_000)]}, 422, "invalid-field"),
    ],
    ids=["recipients", "header-count", "subject", "header-value", "reply-to"],
)
async def test_large_requests_are_refused_before_they_are_built(
    api: Api, pool: asyncpg.Pool, request_: dict[str, Any], status: int, kind: str
) -> None:
    answer, _headers, body = await post(api, request_)
    assert answer == status and json.loads(body)["type"] == TYPE_PREFIX + kind
    assert await pool.fetchval("SELECT count(*) FROM message") == 0


async def test_a_raw_message_to_too_many_recipients_is_refused_unparsed(api: Api) -> None:
    raw = b"From: shop@acme.example\r\nSubject: x\r\n\r\nbody\r\n"
    # As many as fit in aiohttp's 8 KB request line.
    params = [("from", "shop@acme.example")] + [("to", f"r{i}@d.example") for i in range(150)]
    status, _headers, body = await post(api, raw, content_type="message/rfc822", params=params)
    assert status == 422 and json.loads(body)["type"] == TYPE_PREFIX + "too-many-recipients"


async def test_a_long_attachment_filename_folds_in_rfc_2231_continuations(
    api: Api, pool: asyncpg.Pool
) -> None:
    filename = "f" * 20_000 + "-\u00e9t\u00e9.pdf"
    request_ = {
        **GOOD,
        "attachments": [{"filename": filename, "content": base64.b64encode(b"%PDF").decode()}],
    }
    assert (await post(api, request_))[0] == 202
    data = bytes(await pool.fetchval("SELECT body FROM message"))
    assert max(len(line) for line in data.split(b"\r\n")) <= 998
    parsed = email.message_from_bytes(data)
    (attachment,) = [p for p in parsed.walk() if p.get_filename()]
    assert attachment.get_filename() == filename
    assert attachment.get_payload(decode=True) == b"%PDF"


@pytest.mark.parametrize(
    ("method", "path", "payload"),
    [
        ("POST", "/v1/suppressions", {"address": "a\u0000b@x.example", "reason": "r"}),
        ("POST", "/v1/suppressions", {"address": "ab@x.example", "reason": "r\ud800"}),
        ("POST", "/v1/messages", {**GOOD, "text": "hello \ud800"}),
        ("POST", "/v1/messages", {**GOOD, "subject": "a\u0000"}),
        ("GET", "/v1/suppressions?cursor=a%00b", None),
        ("GET", "/v1/suppressions/a%00b@x.example", None),
        ("GET", "/v1/messages?recipient=a%00@x.example", None),
        ("GET", "/v1/messages?since=9999-12-31T23:59:59-14:00", None),
        ("GET", "/v1/messages?since=0001-01-01T00:00:00%2B05:00", None),
        (
            "POST",
            "/v1/suppressions",
            {"address": "c@x.example", "reason": "r", "expires_at": "9999-12-31T23:59:59-14:00"},
        ),
        ("GET", "/v1/messages?limit=%D9%A1%D9%A0", None),  # ARABIC-INDIC "10"
    ],
    ids=[
        "nul-address",
        "surrogate-reason",
        "surrogate-text",
        "nul-subject",
        "nul-cursor",
        "nul-path",
        "nul-recipient",
        "since-overflow",
        "since-underflow",
        "expires-overflow",
        "unicode-limit",
    ],
)
async def test_values_the_database_cannot_store_are_the_clients_not_an_outage(
    api: Api,
    pool: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    payload: dict[str, Any] | None,
) -> None:
    caplog.set_level(logging.INFO)
    body = b"" if payload is None else json.dumps(payload).encode()
    status, _headers, answer = await post(api, body, method=method, path=path)
    assert 400 <= status < 500, (status, answer)
    assert json.loads(answer)["type"] != TYPE_PREFIX + "database-unavailable"
    assert not [r for r in caplog.records if "database trouble" in r.getMessage()]
    assert await pool.fetchval("SELECT count(*) FROM message") == 0
    assert await pool.fetchval("SELECT count(*) FROM suppression") == 0


def test_a_value_the_database_refuses_is_422_and_an_outage_503() -> None:
    refused = problems.database_error(asyncpg.DataError("bad"), "it was not done", "test")
    assert refused.kind is problems.INVALID_VALUE
    away = problems.database_error(
        asyncpg.CannotConnectNowError("starting"), "it was not done", "test"
    )
    assert away.kind is problems.DATABASE_UNAVAILABLE and away.retry_after


async def test_a_body_over_what_the_server_reads_is_refused_unread(api: Api) -> None:
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {api.key}\r\nContent-Length: {10**12}\r\n\r\n"
    )
    answer, closed = await _head_only(api, head)
    assert answer.startswith(b"HTTP/1.1 413 ") and closed
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["type"] == TYPE_PREFIX + "too-large"


async def test_a_chunked_body_without_a_length_is_read_and_queued(
    api: Api, pool: asyncpg.Pool
) -> None:
    """A client that streams its body (Transfer-Encoding: chunked, no Content-Length) holds the
    room of the largest body while it is read, and is queued like any other."""

    async def chunks() -> AsyncIterator[bytes]:
        body = json.dumps(GOOD).encode()
        for start in range(0, len(body), 16):
            yield body[start : start + 16]

    async with aiohttp.ClientSession() as session:
        async with session.post(
            api.url + "/v1/messages",
            data=chunks(),
            headers={"Authorization": f"Bearer {api.key}", "Content-Type": "application/json"},
        ) as answer:
            assert answer.status == 202, await answer.text()
            assert answer.request_info.headers.get("Transfer-Encoding") == "chunked"
    assert await pool.fetchval("SELECT count(*) FROM message") == 1


@pytest.mark.parametrize(
    "head",
    [
        "GET /v1/messages HTTP/1.1\r\nHost: x\r\nX-Long: " + "a" * 9000 + "\r\n\r\n",
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        "Transfer-Encoding: chunked\r\n\r\n{}",
        "GET /v1/mess\x00ages HTTP/1.1\r\nHost: x\r\n\r\n",
        "FROB /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["header-line-over-8190", "brotli", "length-and-chunked", "nul-in-path", "no-method"],
)
async def test_what_the_http_parser_refuses_is_a_problem_too(
    api: Api, pool: asyncpg.Pool, head: str
) -> None:
    """Refused by aiohttp's parser before any handler runs, and still answered as every other
    refusal is (problem+json, its status, what was wrong), never as plain text."""
    answer, _closed = await _head_only(api, head)
    status_line, rest = answer.split(b"\r\n", 1)
    assert status_line.split()[1].startswith(b"4"), answer[:200]
    fields = email.message_from_bytes(rest.split(b"\r\n\r\n", 1)[0])
    assert fields["Content-Type"] == problems.CONTENT_TYPE
    problem = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert problem["status"] == int(status_line.split()[1]) and problem["detail"]
    assert problem["type"].startswith(TYPE_PREFIX)
    assert await pool.fetchval("SELECT count(*) FROM message") == 0
