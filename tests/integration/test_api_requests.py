"""`POST /v1/messages` of the real aiohttp application on loopback, queuing into PostgreSQL: what is
queued for a good request, and a table of bad ones, each refused with its status and problem type
and nothing queued.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ── GroupCommit ── PostgreSQL
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest

from pigeon_mta.api.problems import CONTENT_TYPE, TYPE_PREFIX
from pigeon_mta.config import Duration, Settings
from pigeon_mta.store import apikeys as store_apikeys
from tests.integration.api_helpers import Api, running_api

GOOD: dict[str, Any] = {
    "from": "Shop <shop@acme.example>",
    "to": ["ann@dest.example", "Bob <bob@dest.example>"],
    "bcc": "audit@dest.example",
    "subject": "Your order",
    "text": "Thank you.",
}


@pytest.fixture
async def api(pool: asyncpg.Pool) -> AsyncIterator[Api]:
    async with running_api(pool) as api:
        yield api


async def post(
    api: Api,
    body: bytes | dict[str, Any] | list[Any],
    *,
    key: str | None = "acme",
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    params: list[tuple[str, str]] | None = None,
    path: str = "/v1/messages",
    method: str = "POST",
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": content_type, **(headers or {})}
    if key is not None:
        sent["Authorization"] = "Bearer " + {
            "acme": api.key,
            "other": api.other_key,
            "revoked": api.revoked_key,
        }.get(key, key)
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, api.url + path, data=data, headers=sent, params=params) as answer,
    ):
        return answer.status, dict(answer.headers), await answer.read()


async def test_a_json_message_is_queued_as_mime_with_its_envelope_and_trace(
    api: Api, pool: asyncpg.Pool
) -> None:
    status, headers, body = await post(api, {**GOOD, "headers": {"X-Order": "42"}})
    assert status == 202, body
    assert headers["Content-Type"] == "application/json"
    answer = json.loads(body)
    queue_id = uuid.UUID(answer["queue_id"])
    row = await pool.fetchrow("SELECT * FROM message WHERE id = $1", queue_id)
    assert row["sender"] == "shop@acme.example"
    assert (row["listener"], row["auth_user"]) == ("api", f"apikey:{api.key_id}")
    assert row["lane"] == "transactional" and row["header_message_id"] == answer["message_id"]
    recipients = await pool.fetch(
        "SELECT id, address FROM recipient WHERE message_id = $1", queue_id
    )
    assert {(str(r["id"]), r["address"]) for r in recipients} == {
        (r["id"], r["address"]) for r in answer["recipients"]
    }
    # In the order the request named them.
    assert [r["address"] for r in answer["recipients"]] == [
        "ann@dest.example",
        "bob@dest.example",
        "audit@dest.example",
    ]
    data = bytes(row["body"])
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("X-Pigeon-Submitted: by ")
    assert f"id {queue_id};" in head
    # Which key sent it is the database's and the log's (auth_user above), not the recipients'.
    assert str(api.key_id) not in data.decode() and "API key" not in head
    assert "Received:" not in head and "audit@" not in head  # Bcc is envelope only
    assert "From: Shop <shop@acme.example>" in head and "X-Order: 42" in head
    assert f"Message-ID: <{answer['message_id']}>" in head and "\r\nDate: " in head
    assert api.queued == [3]


async def test_a_raw_message_keeps_its_bytes_and_takes_the_envelope_from_the_query(
    api: Api, pool: asyncpg.Pool
) -> None:
    raw = (
        b"From: shop@acme.example\r\nTo: ann@dest.example\r\nSubject: raw\r\n"
        b"Message-ID: <raw-1@acme.example>\r\nX-Pigeon-Lane: bulk\r\n\r\nbody\n"
    )
    status, _headers, body = await post(
        api,
        raw,
        content_type="message/rfc822",
        params=[
            ("from", "shop@acme.example"),
            ("to", "ann@dest.example"),
            ("to", "cat@dest.example"),
        ],
    )
    assert status == 202, body
    answer = json.loads(body)
    assert answer["message_id"] == "raw-1@acme.example"
    row = await pool.fetchrow(
        "SELECT body, lane FROM message WHERE id = $1", uuid.UUID(answer["queue_id"])
    )
    assert row["lane"] == "bulk"
    # Its own fields as written (the lane field taken out), a Date added, the body in CRLF.
    data = bytes(row["body"])
    assert b"\r\nSubject: raw\r\nMessage-ID: <raw-1@acme.example>\r\nDate: " in data
    assert b"X-Pigeon-Lane" not in data and data.endswith(b"\r\n\r\nbody\r\n")
    assert [r["address"] for r in answer["recipients"]] == ["ann@dest.example", "cat@dest.example"]


async def test_addresses_take_the_rules_of_an_smtputf8_submission(
    api: Api, pool: asyncpg.Pool
) -> None:
    """As the SMTP listeners do with SMTPUTF8: a U-label domain is queued in A-labels, and a raw
    message's envelope may name a UTF-8 local part (RFC 6531; delivered where the destination
    offers SMTPUTF8, outbound/attempt.py)."""
    status, _headers, body = await post(api, _json(to=["Anna <anna@Bücher.example>"]))
    assert status == 202, body
    queued = json.loads(body)
    assert queued["recipients"][0]["address"] == "anna@xn--bcher-kva.example"
    row = await pool.fetchrow(
        "SELECT body FROM message WHERE id = $1", uuid.UUID(queued["queue_id"])
    )
    assert b"To: Anna <anna@xn--bcher-kva.example>\r\n" in bytes(row["body"])

    raw = "From: shop@acme.example\r\nTo: jürgen@dest.example\r\nSubject: eai\r\n\r\nhi\r\n"
    status, _headers, body = await post(
        api,
        raw.encode(),
        content_type="message/rfc822",
        params=[("from", "shop@acme.example"), ("to", "jürgen@dest.example")],
    )
    assert status == 202, body
    assert [r["address"] for r in json.loads(body)["recipients"]] == ["jürgen@dest.example"]
    domains = await pool.fetch("SELECT DISTINCT domain FROM recipient ORDER BY domain")
    assert [d["domain"] for d in domains] == ["dest.example", "xn--bcher-kva.example"]


def _json(**changes: Any) -> dict[str, Any]:
    request = {**GOOD, **changes}
    return {k: v for k, v in request.items() if v is not None}


_RAW_PARAMS = [("from", "shop@acme.example"), ("to", "ann@dest.example")]
_RAW = b"From: shop@acme.example\r\nSubject: hi\r\n\r\nbody\r\n"
_BIG = base64.b64encode(b"\0" * (30 * 1024 * 1024)).decode()

# (name, request, expected status, expected problem type)
BAD: list[tuple[str, dict[str, Any], int, str]] = [
    ("bad JSON", {"body": b'{"from": '}, 400, "invalid-json"),
    ("JSON that is no object", {"body": [1, 2]}, 400, "invalid-json"),
    ("missing from", {"body": _json(**{"from": None})}, 422, "invalid-field"),
    ("unknown field", {"body": _json(sender="x")}, 422, "invalid-field"),
    ("no text or html", {"body": _json(text=None)}, 422, "invalid-field"),
    ("no recipient", {"body": _json(to=[], bcc=None)}, 422, "invalid-field"),
    ("subject not a string", {"body": _json(subject=7)}, 422, "invalid-field"),
    (
        "1,001 recipients",
        {"body": _json(to=[f"r{i}@dest.example" for i in range(1001)])},
        422,
        "too-many-recipients",
    ),
    (
        "CRLF in the subject",
        {"body": _json(subject="Hi\r\nBcc: x@evil.example")},
        422,
        "invalid-header",
    ),
    ("LF in a header value", {"body": _json(headers={"X-A": "a\nB: c"})}, 422, "invalid-header"),
    ("CRLF in a header name", {"body": _json(headers={"X-A\r\nBcc": "x"})}, 422, "invalid-header"),
    (
        "a header the fields set",
        {"body": _json(headers={"Content-Type": "text/x"})},
        422,
        "invalid-header",
    ),
    ("bad address", {"body": _json(to=["not an address"])}, 422, "invalid-address"),
    ("non-ASCII local part", {"body": _json(to=["jürgen@dest.example"])}, 422, "invalid-address"),
    ("address literal", {"body": _json(to=["root@[192.0.2.1]"])}, 422, "invalid-address"),
    ("unknown lane", {"body": _json(lane="express")}, 422, "unknown-lane"),
    (
        "bad base64",
        {"body": _json(attachments=[{"filename": "a.pdf", "content": "@@"}])},
        422,
        "invalid-field",
    ),
    (
        "30 MB attachment",
        {"body": _json(attachments=[{"filename": "big.bin", "content": _BIG}])},
        413,
        "too-large",
    ),
    ("no key", {"body": GOOD, "key": None}, 401, "unauthorized"),
    ("wrong key", {"body": GOOD, "key": "pgn_wrong"}, 401, "unauthorized"),
    ("revoked key", {"body": GOOD, "key": "revoked"}, 401, "unauthorized"),
    (
        "another org's sender domain",
        {"body": _json(**{"from": "x@other.example"})},
        403,
        "sender-not-owned",
    ),
    (
        "the other org's key for acme's domain",
        {"body": GOOD, "key": "other"},
        403,
        "sender-not-owned",
    ),
    (
        "wrong content type",
        {"body": GOOD, "content_type": "text/plain"},
        415,
        "unsupported-media-type",
    ),
    (
        "JSON sent as message/rfc822",
        {"body": GOOD, "content_type": "message/rfc822"},
        422,
        "invalid-field",
    ),
    (
        "raw without to",
        {"body": _RAW, "content_type": "message/rfc822", "params": _RAW_PARAMS[:1]},
        422,
        "invalid-field",
    ),
    (
        "raw without a header",
        {"body": b"just text\r\n", "content_type": "message/rfc822", "params": _RAW_PARAMS},
        400,
        "invalid-message",
    ),
    (
        "raw From: of another org",
        {
            "body": b"From: x@other.example\r\n\r\nb\r\n",
            "content_type": "message/rfc822",
            "params": _RAW_PARAMS,
        },
        403,
        "sender-not-owned",
    ),
    (
        "raw with an unknown X-Pigeon-Lane",
        {
            "body": b"From: shop@acme.example\r\nX-Pigeon-Lane: fast\r\n\r\nb\r\n",
            "content_type": "message/rfc822",
            "params": _RAW_PARAMS,
        },
        422,
        "unknown-lane",
    ),
    (
        "a 30 MB raw message",
        {
            "body": _RAW + b"x" * (30 * 1024 * 1024),
            "content_type": "message/rfc822",
            "params": _RAW_PARAMS,
        },
        413,
        "too-large",
    ),
    (
        "Idempotency-Key too long",
        {"body": GOOD, "headers": {"Idempotency-Key": "k" * 256}},
        422,
        "invalid-header",
    ),
    ("PUT on the messages route", {"body": GOOD, "method": "PUT"}, 405, "method-not-allowed"),
    ("no such route", {"body": GOOD, "path": "/v1/nothing"}, 404, "not-found"),
]


@pytest.mark.parametrize(("name", "request_", "status", "kind"), BAD, ids=[b[0] for b in BAD])
async def test_a_bad_request_is_refused_with_its_problem_and_nothing_is_queued(
    api: Api, pool: asyncpg.Pool, name: str, request_: dict[str, Any], status: int, kind: str
) -> None:
    args = dict(request_)
    got, headers, body = await post(api, args.pop("body"), **args)
    assert got == status, body[:500]
    assert headers["Content-Type"] == CONTENT_TYPE
    problem = json.loads(body)
    assert problem["type"] == TYPE_PREFIX + kind and problem["status"] == status
    assert problem["title"] and problem["detail"].endswith(".")
    assert "\n" not in problem["detail"] and len(problem["detail"]) < 300
    assert await pool.fetchval("SELECT count(*) FROM message") == 0
    assert await pool.fetchval("SELECT count(*) FROM recipient") == 0
    assert await pool.fetchval("SELECT count(*) FROM idempotency_key") == 0
    assert api.queued == []


async def test_the_detail_names_the_field(api: Api) -> None:
    for body, field in (
        (_json(subject="a\r\nb"), "'subject'"),
        (_json(headers={"X-A\r\nB": "x"}), "'headers'"),
        (_json(to=["ok@dest.example", "bad"]), "'to[1]'"),
        (_json(attachments=[{"filename": "a", "content": "@"}]), "'attachments[0].content'"),
    ):
        _status, _headers, answer = await post(api, body)
        assert field in json.loads(answer)["detail"], answer


async def test_a_key_over_its_rate_gets_429_with_retry_after(pool: asyncpg.Pool) -> None:
    from pigeon_mta.config import LimitsSettings, Settings

    settings = Settings(limits=LimitsSettings(credential_rate_limit=2))
    async with running_api(pool, settings) as api:
        for _ in range(2):
            assert (await post(api, GOOD))[0] == 202
        status, headers, body = await post(api, GOOD)
        assert status == 429 and json.loads(body)["type"] == TYPE_PREFIX + "rate-limited"
        assert int(headers["Retry-After"]) > 0
        assert await pool.fetchval("SELECT count(*) FROM message") == 2


async def test_idempotency_key_repeats_answer_once_and_another_body_is_refused(
    api: Api, pool: asyncpg.Pool
) -> None:
    headers = {"Idempotency-Key": "order-42"}
    answers = await asyncio.gather(*(post(api, GOOD, headers=headers) for _ in range(5)))
    assert {(status, body) for status, _h, body in answers} == {(answers[0][0], answers[0][2])}
    assert answers[0][0] == 202
    assert await pool.fetchval("SELECT count(*) FROM message") == 1
    status, _h, body = await post(api, _json(subject="another"), headers=headers)
    assert status == 422 and json.loads(body)["type"] == TYPE_PREFIX + "idempotency-key-reused"
    # Another org's use of the same key is its own.
    status, _h, _body = await post(
        api, _json(**{"from": "x@other.example"}), key="other", headers=headers
    )
    assert status == 202
    assert await pool.fetchval("SELECT count(*) FROM message") == 2


@pytest.mark.parametrize(("auth_cache", "after_revoking"), [(0.0, 401), (3600.0, 202)])
async def test_a_key_revoked_while_the_server_runs_is_refused_as_api_auth_cache_says(
    pool: asyncpg.Pool, auth_cache: float, after_revoking: int
) -> None:
    settings = Settings()
    settings = dataclasses.replace(
        settings, api=dataclasses.replace(settings.api, auth_cache=Duration(auth_cache))
    )
    async with running_api(pool, settings) as api:
        status, _h, body = await post(api, GOOD)
        assert status == 202, body
        assert await store_apikeys.revoke_api_key(pool, api.key_id) is not None
        # "0" asks the database at every request; a long cache keeps the found key that long.
        status, _h, body = await post(api, GOOD)
        assert status == after_revoking, body


@pytest.mark.parametrize(("header", "lane"), [("lower", "bulk"), ("any", "transactional")])
async def test_a_keys_lane_and_the_requests_lane_as_lanes_header_allows(
    pool: asyncpg.Pool, header: str, lane: str
) -> None:
    """A key the operator put in `bulk` asks for `transactional` in its request: "lower" (the
    default) keeps it in bulk, "any" lets it move."""
    settings = dataclasses.replace(Settings(), lane_header=header)
    async with running_api(pool, settings) as api:
        _row, bulk_key = await store_apikeys.add_api_key(pool, api.acme, lane="bulk")
        status, _headers, body = await post(api, {**GOOD, "lane": "transactional"}, key=bulk_key)
        assert status == 202, body
        queued = await pool.fetchval(
            "SELECT lane FROM message WHERE id = $1", uuid.UUID(json.loads(body)["queue_id"])
        )
    assert queued == lane


async def test_a_reused_message_id_with_another_body_is_queued_through_the_api_too(
    api: Api, pool: asyncpg.Pool
) -> None:
    def raw(code: str) -> bytes:
        return (
            b"From: shop@acme.example\r\nTo: ann@dest.example\r\nSubject: code\r\n"
            b"Message-ID: <code@acme.example>\r\n\r\nYour code is " + code.encode() + b".\r\n"
        )

    params = [("from", "shop@acme.example"), ("to", "ann@dest.example")]
    answers = []
    for data in (raw("1111"), raw("2222"), raw("2222")):
        status, _headers, body = await post(api, data, content_type="message/rfc822", params=params)
        assert status == 202, body
        answers.append(json.loads(body)["queue_id"])
    first, other, retry = answers
    assert other != first and retry == other
    assert await pool.fetchval("SELECT count(*) FROM message") == 2
    assert await pool.fetchval(
        "SELECT reuses FROM message WHERE id = $1", uuid.UUID(other)
    ) == uuid.UUID(first)


async def test_an_idempotent_repeat_is_the_same_json_however_it_is_spaced(
    api: Api, pool: asyncpg.Pool
) -> None:
    """The same request from another JSON library (other spacing, other key order) is a repeat,
    answered with the first answer; a changed value is not."""
    headers = {"Idempotency-Key": "spaced"}
    first = await post(api, json.dumps(GOOD).encode(), headers=headers)
    respaced = json.dumps(dict(reversed(list(GOOD.items()))), indent=4).encode()
    again = await post(api, respaced, headers=headers)
    assert first[0] == again[0] == 202 and first[2] == again[2]
    assert await pool.fetchval("SELECT count(*) FROM message") == 1
    changed = await post(api, _json(text="Thank you!"), headers=headers)
    assert changed[0] == 422


async def test_a_method_a_route_does_not_take_says_which_it_does(api: Api) -> None:
    status, headers, body = await post(api, b"", method="PUT", path="/v1/messages")
    assert status == 405 and json.loads(body)["type"] == TYPE_PREFIX + "method-not-allowed"
    assert set(headers["Allow"].split(", ")) == {"GET", "HEAD", "POST"}


async def test_every_answer_is_counted_by_route_method_and_status(api: Api) -> None:
    """pigeon_api_requests_total{route,method,status}: the route's pattern, not the path (a
    queue id would make a series per message), and "other" for a path or method no route
    takes."""
    from pigeon_mta.metrics import API_REQUEST_SECONDS, API_REQUESTS

    def count(route: str, method: str, status: int) -> float:
        sample = API_REQUESTS.labels(route=route, method=method, status=str(status))
        return float(sample._value.get())  # type: ignore[attr-defined]

    before = {
        "sent": count("/v1/messages", "POST", 202),
        "one": count("/v1/messages/{queue_id}", "GET", 404),
        "nowhere": count("other", "GET", 404),
        "odd": count("other", "other", 405),
    }
    assert (await post(api, GOOD))[0] == 202
    missing = "/v1/messages/01900000-0000-7000-8000-000000000000"
    assert (await post(api, b"", method="GET", path=missing))[0] == 404
    assert (await post(api, b"", method="GET", path="/nowhere"))[0] == 404
    frob = await post(api, b"", method="PROPFIND", path="/v1/messages")
    assert frob[0] == 405, frob
    assert count("/v1/messages", "POST", 202) == before["sent"] + 1
    assert count("/v1/messages/{queue_id}", "GET", 404) == before["one"] + 1
    assert count("other", "GET", 404) == before["nowhere"] + 1
    assert count("other", "other", 405) == before["odd"] + 1
    timed = API_REQUEST_SECONDS.labels(route="/v1/messages")
    assert timed._sum.get() > 0  # type: ignore[attr-defined]
