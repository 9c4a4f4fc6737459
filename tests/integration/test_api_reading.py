"""`GET /v1/messages/{queue_id}` and `GET /v1/messages` of the real application on loopback,
reading PostgreSQL: the owner reads its messages' timelines and pages through them, another org's
key finds nothing, and bad query parameters are refused naming the parameter.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ── GroupCommit ── PostgreSQL
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest

from pigeon_mta.api.problems import CONTENT_TYPE, TYPE_PREFIX
from pigeon_mta.delivery_records import story_records
from pigeon_mta.store import events
from tests.integration.api_helpers import Api, running_api


@pytest.fixture
async def api(pool: asyncpg.Pool) -> AsyncIterator[Api]:
    async with running_api(pool) as api:
        yield api


async def call(
    api: Api,
    path: str,
    *,
    key: str = "acme",
    method: str = "GET",
    body: dict[str, Any] | None = None,
    params: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": "Bearer " + {"acme": api.key, "other": api.other_key}[key]}
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, api.url + path, json=body, headers=headers, params=params
        ) as answer,
    ):
        raw = await answer.read()
        return answer.status, dict(answer.headers), json.loads(raw) if raw else None


async def send(api: Api, to: str | list[str], subject: str = "Hello") -> dict[str, Any]:
    body = {"from": "shop@acme.example", "to": to, "subject": subject, "text": "Hi."}
    status, _headers, answer = await call(api, "/v1/messages", method="POST", body=body)
    assert status == 202, answer
    return dict(answer)


def assert_problem(
    status: int, headers: dict[str, str], body: Any, expected: int, kind: str
) -> None:
    assert status == expected, body
    assert headers["Content-Type"] == CONTENT_TYPE
    assert body["type"] == TYPE_PREFIX + kind and body["status"] == expected


async def test_the_owner_reads_a_timeline_with_the_events_of_pigeon_mta_log(
    api: Api, pool: asyncpg.Pool
) -> None:
    sent = await send(api, ["ann@dest.example", "bob@dest.example"])
    status, headers, timeline = await call(api, f"/v1/messages/{sent['queue_id']}")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert timeline["queue_id"] == sent["queue_id"]
    assert timeline["message_id"] == sent["message_id"]
    assert timeline["sender"] == "shop@acme.example" and timeline["lane"] == "transactional"
    assert {(r["address"], r["status"], r["attempts"]) for r in timeline["recipients"]} == {
        ("ann@dest.example", "queued", 0),
        ("bob@dest.example", "queued", 0),
    }
    assert {r["id"] for r in timeline["recipients"]} == {r["id"] for r in sent["recipients"]}
    # The events are the records `pigeon-mta log QUEUE_ID --json` prints, field for field.
    lookup = await events.find_stories(pool, sent["queue_id"], limit=10)
    assert lookup is not None
    assert timeline["events"] == [r for story in lookup.stories for r in story_records(story)]
    assert [(e["type"], e["recipient"]) for e in timeline["events"]] == [
        ("Reception", "ann@dest.example"),
        ("Reception", "bob@dest.example"),
    ]


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("another org's queue id", "mine"),
        # A fixed id: every worker of a parallel run collects the same test names.
        ("an unknown queue id", "/v1/messages/7f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0"),
        ("a malformed queue id", "/v1/messages/not-a-queue-id"),
        ("an id too long", "/v1/messages/" + "0" * 300),
    ],
)
async def test_a_message_the_key_may_not_read_is_404(api: Api, name: str, path: str) -> None:
    if path == "mine":
        path = f"/v1/messages/{(await send(api, 'ann@dest.example'))['queue_id']}"
    status, headers, body = await call(api, path, key="other")
    assert_problem(status, headers, body, 404, "not-found")
    assert "queue id" in body["detail"]


async def test_pages_hold_every_message_once_while_new_mail_arrives(api: Api) -> None:
    first = [(await send(api, f"u{i}@dest.example"))["queue_id"] for i in range(23)]
    seen: list[str] = []
    arrived: list[str] = []
    params: dict[str, str] = {"limit": "5"}
    for _page in range(20):  # bounded: 23 messages in pages of 5
        status, _headers, page = await call(api, "/v1/messages", params=params)
        assert status == 200, page
        seen.extend(m["queue_id"] for m in page["messages"])
        # New mail between pages: it sorts above the pages already read.
        arrived.append((await send(api, "late@dest.example"))["queue_id"])
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == first[::-1]
    status, _headers, newest = await call(api, "/v1/messages", params={"limit": "3"})
    assert [m["queue_id"] for m in newest["messages"]] == arrived[::-1][:3]
    # Another org's key sees none of them.
    status, _headers, other = await call(api, "/v1/messages", key="other")
    assert status == 200 and other == {"messages": [], "next_cursor": None}


async def test_filters_pick_the_org_s_messages(api: Api, pool: asyncpg.Pool) -> None:
    ann = await send(api, ["Ann@Dest.Example", "zed@dest.example"])
    bob = await send(api, "bob@dest.example")
    await pool.execute(
        "UPDATE recipient SET status = 'bounced' WHERE message_id = $1", uuid.UUID(bob["queue_id"])
    )

    async def listed(key: str = "acme", **params: str) -> list[str]:
        status, _headers, page = await call(api, "/v1/messages", key=key, params=params)
        assert status == 200, page
        return [m["queue_id"] for m in page["messages"]]

    # Found by the spellings `pigeon-mta log` looks for: as typed, and in lower case.
    assert await listed(recipient="Ann@Dest.Example") == [ann["queue_id"]]
    assert await listed(recipient="ZED@Dest.Example") == [ann["queue_id"]]
    assert await listed(recipient="Ann@Dest.Example", key="other") == []
    assert await listed(message_id=f"<{bob['message_id']}>") == [bob["queue_id"]]
    assert await listed(message_id=bob["message_id"], key="other") == []
    assert await listed(status="bounced") == [bob["queue_id"]]
    assert await listed(status="queued") == [ann["queue_id"]]
    assert await listed(recipient="bob@dest.example", status="queued") == []
    assert await listed(since="2000-01-01T00:00:00Z") == [bob["queue_id"], ann["queue_id"]]
    assert await listed(since="2999-01-01") == []

    _status, _headers, page = await call(api, "/v1/messages", params={"status": "queued"})
    (message,) = page["messages"]
    assert set(message) == {"queue_id", "kind", "message_id", "received_at", "lane", "recipients"}
    assert sorted((r["address"], r["status"]) for r in message["recipients"]) == [
        ("Ann@dest.example", "queued"),
        ("zed@dest.example", "queued"),
    ]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"limit": "100000"}, "limit"),
        ({"status": "lost"}, "status"),
        ({"since": "yesterday"}, "since"),
        ({"cursor": "bm90IGEgY3Vyc29y"}, "cursor"),
        ({"cursor": "!!"}, "cursor"),
        ({"recipient": "nobody"}, "recipient"),
        ({"message_id": "<>"}, "message_id"),
        ({"colour": "blue"}, "colour"),
    ],
)
async def test_a_bad_parameter_is_400_naming_it(
    api: Api, params: dict[str, str], named: str
) -> None:
    status, headers, body = await call(api, "/v1/messages", params=params)
    assert_problem(status, headers, body, 400, "invalid-parameter")
    assert f"'{named}'" in body["detail"]


async def test_pages_of_a_failed_status_hold_each_message_once(
    api: Api, pool: asyncpg.Pool
) -> None:
    """Messages with several bounced recipients, read through the index of failed recipients:
    one entry per message, and no page ends early."""
    sent = [(await send(api, ["a@dest.example", "b@dest.example"]))["queue_id"] for _ in range(7)]
    await pool.execute("UPDATE recipient SET status = 'bounced'")
    seen: list[str] = []
    params = {"status": "bounced", "limit": "3"}
    for _page in range(10):  # bounded: 7 messages in pages of 3
        status, _headers, page = await call(api, "/v1/messages", params=params)
        assert status == 200, page
        seen.extend(m["queue_id"] for m in page["messages"])
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == sent[::-1]


async def test_a_dsn_pigeon_made_for_the_org_is_marked_as_one(api: Api, pool: asyncpg.Pool) -> None:
    """A delivery status notification queued for the org's sender shows in its messages under
    a queue id the application never made: `kind` says "dsn"; its own mail says "message"."""
    from pigeon_mta.model import DSN_LISTENER, Envelope
    from pigeon_mta.store import queue

    mine = await send(api, "ann@dest.example")
    org_id = await pool.fetchval("SELECT org_id FROM message WHERE id = $1", mine["queue_id"])
    dsn = await queue.enqueue(
        pool,
        Envelope(
            org_id=org_id,
            sender="",
            recipients=("shop@acme.example",),
            body=b"From: MAILER-DAEMON@mta.test\r\nSubject: Undelivered\r\n\r\nSorry.\r\n",
            listener=DSN_LISTENER,
        ),
    )
    status, _headers, page = await call(api, "/v1/messages")
    assert status == 200
    kinds = {m["queue_id"]: m["kind"] for m in page["messages"]}
    assert kinds == {mine["queue_id"]: "message", str(dsn): "dsn"}
    status, _headers, one = await call(api, f"/v1/messages/{dsn}")
    assert status == 200 and one["kind"] == "dsn" and one["sender"] == ""
