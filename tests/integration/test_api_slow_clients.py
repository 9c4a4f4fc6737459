"""Slowloris against the real API server on loopback: a client that trickles its request head or
body is cut off after `[api] read_timeout`, and other clients are served meanwhile.

raw socket (one byte every DRIP s) ──► ApiService 127.0.0.1:<free port> ◄── aiohttp client
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from pigeon_mta.config import Duration, Settings
from tests.integration.api_helpers import Api, running_api

READ_TIMEOUT = 1.0
DRIP = 0.1  # seconds between the bytes of a trickle
# A trickle gives up after this many bytes (15 s, fifteen read timeouts): a server that lets it
# reach the end has no bound.
MAX_DRIPS = 150


@pytest.fixture
async def api(pool: asyncpg.Pool) -> AsyncIterator[Api]:
    settings = Settings()
    settings = dataclasses.replace(
        settings, api=dataclasses.replace(settings.api, read_timeout=Duration(READ_TIMEOUT))
    )
    async with running_api(pool, settings) as api:
        yield api


async def trickled(api: Api, head: bytes, drip: bytes = b"a") -> tuple[bytes, int]:
    """Send `head` at once, then `drip` every DRIP seconds until the server closes the
    connection; returns what the server sent and how many drips the trickle got in. Meanwhile
    another client reads the OpenAPI document."""
    host, port = api.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    closed = asyncio.Event()

    async def trickle() -> int:
        writer.write(head)
        for drips in range(MAX_DRIPS):
            if closed.is_set():
                return drips
            try:
                writer.write(drip)
                await writer.drain()
            except ConnectionError:
                return drips
            await asyncio.sleep(DRIP)
        return MAX_DRIPS

    async def answer() -> bytes:
        try:
            return await reader.read()  # to EOF: the server closed the connection
        finally:
            closed.set()

    trickling = asyncio.create_task(trickle())
    answering = asyncio.create_task(answer())
    try:
        await asyncio.sleep(DRIP * 3)
        async with (
            aiohttp.ClientSession() as session,
            session.get(api.url + "/v1/openapi.json") as other,
        ):
            assert other.status == 200 and (await other.json())["openapi"] == "3.1.0"
        assert not answering.done()  # the trickle was still going when the other was served
        drips = await trickling
        got = await asyncio.wait_for(answering, timeout=DRIP * MAX_DRIPS)
    finally:
        trickling.cancel()
        answering.cancel()
        writer.close()
    return got, drips


async def test_a_client_trickling_its_header_fields_is_cut_off(api: Api) -> None:
    got, drips = await trickled(api, b"GET /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    assert got == b""  # closed without an answer: there was no request to answer
    assert drips < MAX_DRIPS


async def test_a_client_trickling_its_body_is_answered_408_and_cut_off(api: Api) -> None:
    head = (
        "POST /v1/suppressions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {api.key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {MAX_DRIPS * 2}\r\n\r\n"
    ).encode()
    got, drips = await trickled(api, head)
    assert drips < MAX_DRIPS
    status_line, _, rest = got.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", got[:300]
    problem = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert problem["type"] == "urn:pigeon-mta:problem:request-timeout"
    assert b"Connection: close" in rest


async def test_a_connection_that_sends_nothing_is_closed(api: Api) -> None:
    got, drips = await trickled(api, b"", drip=b"")
    assert got == b"" and drips < MAX_DRIPS
