"""The send intent under `pigeon-mta serve`, through its doors: ordering keys and metadata as
X-Pigeon-* header fields over SMTP, a deadline and a schedule as the API's JSON fields.

    smtplib ──SMTP (trusted relay listener)──► serve ◄──HTTP── aiohttp client (API key)
                                                 │ PostgreSQL queue
                 aiosmtpd sink 127.0.0.2 ◄──SMTP─┤ (relayhost; tempfail+..., full@ choose replies)
                 webhook receiver 127.0.0.1 ◄────┘ (every event type)

The sink's `tempfail` recipients get 451 the first time, `full` gets 452 every time; retries
come after 1 s, 2 s at most.
"""

from __future__ import annotations

import asyncio
import json
import re
import smtplib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.conftest import free_port
from tests.e2e.relay_serve import Relay, pigeon_with, relay_serve
from tests.e2e.serve_process import ServeProcess
from tests.peers.webhook_receiver import WebhookReceiver

QUEUED = re.compile(r"queued as ([0-9a-f-]{36})")


@pytest.fixture
async def receiver() -> AsyncIterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    await receiver.start()
    try:
        yield receiver
    finally:
        await receiver.stop()


def serve_of(tmp_path: Path, db_url: str, relay_port: int, hook: str) -> Any:
    return relay_serve(
        tmp_path,
        db_url,
        node_name="e2e-intent",
        submission=False,
        api=True,
        listeners=[{"name": "relay", "address": f"127.0.0.1:{relay_port}", "mode": "relay"}],
        tables={
            "relay": {"trusted_org": "acme"},
            "delivery": {"retry_initial": "1s", "retry_max": "2s", "poll_interval": "250ms"},
        },
        setup=[
            ("apikey", "add", "acme", "--name", "app", "--json"),
            ("webhook", "add", "acme", hook, "--json"),
        ],
    )


def smtp_send(port: int, n: int, to: str, headers: dict[str, str]) -> str:
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    message = (
        f"From: app@acme.example\r\nTo: {to}\r\nSubject: message {n}\r\n"
        f"Message-ID: <m{n}@app.example>\r\n{fields}\r\nbody {n}\r\n"
    )
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.ehlo("app.test")
        smtp.mail("app@acme.example")
        smtp.rcpt(to)
        code, text = smtp.data(message.encode())
    assert code == 250, text
    found = QUEUED.search(text.decode())
    assert found, text
    return found.group(1)


def smtp_refusal(port: int, headers: dict[str, str]) -> tuple[int, str]:
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    message = f"From: app@acme.example\r\nTo: x@dest.test\r\n{fields}\r\nbody\r\n"
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.ehlo("app.test")
        smtp.mail("app@acme.example")
        smtp.rcpt("x@dest.test")
        code, text = smtp.data(message.encode())
    return code, text.decode()


def subjects(relay: Relay, to: str) -> list[str]:
    """The Subjects the sink took for `to`, in the order they arrived."""
    out = []
    for m in relay.sink.messages:
        if to in m.rcpt_tos and m.replied:
            out.append(m.data.split(b"Subject: ", 1)[1].split(b"\r\n", 1)[0].decode())
    return out


async def wait_until(check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("not within the time")


async def test_one_key_arrives_in_order_others_at_once_and_metadata_goes_everywhere_but_out(
    tmp_path: Path, db_url: str, receiver: WebhookReceiver
) -> None:
    relay_port = free_port()
    async with serve_of(tmp_path, db_url, relay_port, receiver.url) as relay:
        api_key = json.loads(relay.prepared[0])["key"]
        ordered = "tempfail+order@dest.test"
        ids = []
        for n in (1, 2, 3):
            headers = {"X-Pigeon-Order-Key": "account-7", "X-Pigeon-Meta-Event": f"evt-{n}"}
            ids.append(await asyncio.to_thread(smtp_send, relay_port, n, ordered, headers))
        headers = {"X-Pigeon-Order-Key": "account-8", "X-Pigeon-Meta-Event": "evt-4"}
        ids.append(await asyncio.to_thread(smtp_send, relay_port, 4, "other@dest.test", headers))

        await wait_until(lambda: len(subjects(relay, ordered)) == 3)
        # The first was deferred once (451), and the two after it waited for it: 1, 2, 3.
        assert subjects(relay, ordered) == ["message 1", "message 2", "message 3"]
        assert relay.sink.rcpt_commands[ordered] == 4  # one 451, then one RCPT each
        # Another key is never held: it arrived before the first one's retry.
        arrived = [m.data for m in relay.sink.messages if m.replied]
        first = next(i for i, d in enumerate(arrived) if b"Subject: message 1\r\n" in d)
        fourth = next(i for i, d in enumerate(arrived) if b"Subject: message 4\r\n" in d)
        assert fourth < first
        # The intent's fields never leave.
        assert not any(b"X-Pigeon-Order-Key" in d or b"X-Pigeon-Meta" in d for d in arrived)

        # Metadata in every webhook event of the messages, in log and in the API.
        await receiver.wait_for(
            lambda: sum(e["type"] == "delivered" for e in receiver.events()) >= 4
        )
        for event in receiver.events():
            n = ids.index(event["data"]["queue_id"]) + 1
            assert event["data"]["metadata"] == {"event": f"evt-{n}"}, event
        assert {e["type"] for e in receiver.events()} == {"delivered", "deferred"}
        shown = await pigeon_with(relay.config, "log", ids[1])
        assert "metadata    event=evt-2" in shown or "event=evt-2" in shown, shown
        assert "account-7" in shown, shown
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
            async with http.get(f"{relay.api_url}/v1/messages/{ids[1]}") as answer:
                message = await answer.json()
            async with http.get(
                f"{relay.api_url}/v1/messages", params={"metadata.event": "evt-2"}
            ) as answer:
                listed = await answer.json()
        assert (message["metadata"], message["order_key"]) == ({"event": "evt-2"}, "account-7")
        reception = message["events"][0]  # as `log --json` prints it
        assert reception["type"] == "Reception", reception
        assert (reception["metadata"], reception["order_key"]) == ({"event": "evt-2"}, "account-7")
        assert [m["queue_id"] for m in listed["messages"]] == [ids[1]]

        # An unknown X-Pigeon-* field, or a bad value, is refused by name: nothing is queued.
        code, text = await asyncio.to_thread(smtp_refusal, relay_port, {"X-Pigeon-Color": "red"})
        assert (code, text) == (550, "5.6.0 X-Pigeon-Color: is not a field pigeon-mta knows")
        code, text = await asyncio.to_thread(smtp_refusal, relay_port, {"X-Pigeon-Expires": "soon"})
        assert code == 550 and text.startswith("5.6.0 X-Pigeon-Expires: must be an RFC 3339")
    assert relay.exit_code == 0, relay.serve.output


async def api_send(relay: Relay, key: str, to: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"from": "app@acme.example", "to": [to], "subject": "s", "text": "t", **fields}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        async with http.post(f"{relay.api_url}/v1/messages", json=body) as answer:
            return answer.status, await answer.json()


async def test_a_deadline_is_kept_and_a_schedule_survives_a_restart(
    tmp_path: Path, db_url: str, receiver: WebhookReceiver
) -> None:
    relay_port = free_port()
    async with serve_of(tmp_path, db_url, relay_port, receiver.url) as relay:
        key = json.loads(relay.prepared[0])["key"]
        # A destination that defers every time, a deadline 5 s ahead.
        status, sent = await api_send(relay, key, "full@dest.test", expires_at=5)
        assert status == 202, sent
        expires = datetime.now(UTC) + timedelta(seconds=5)
        doomed = sent["queue_id"]
        # A schedule 5 s ahead, then serve stops and starts again before it.
        status, sent = await api_send(relay, key, "later@dest.test", send_at=5)
        assert status == 202, sent
        scheduled = sent["queue_id"]
        accepted = time.monotonic()
        queue = json.loads(await pigeon_with(relay.config, "queue", "--json"))
        assert queue["scheduled"] == 1, queue
        await asyncio.to_thread(relay.serve.stop)
        relay.serve = ServeProcess("--config", str(relay.config))
        await asyncio.to_thread(relay.serve.wait_for, "worker 0 ready")
        await wait_until(lambda: bool(subjects(relay, "later@dest.test")), timeout=60)
        assert time.monotonic() - accepted >= 5
        shown = await pigeon_with(relay.config, "log", scheduled)
        assert "scheduled   not attempted before" in shown, shown

        # The deadline: attempted before it, never after, then expired as `deadline`.
        pool = await asyncpg.connect(db_url)
        try:
            await wait_until_async(
                lambda: pool.fetchval(
                    "SELECT status FROM recipient WHERE message_id = $1", uuidof(doomed)
                ),
                "expired",
            )
            attempts = await pool.fetch(
                "SELECT started_at, outcome, category FROM attempt WHERE message_id = $1 "
                "ORDER BY started_at",
                uuidof(doomed),
            )
            deadline = await pool.fetchval(
                "SELECT expires_at FROM message WHERE id = $1", uuidof(doomed)
            )
        finally:
            await pool.close()
        assert abs((deadline - expires).total_seconds()) < 3
        assert [a["outcome"] for a in attempts][-1] == "expired"
        assert attempts[-1]["category"] == "deadline"
        tried = [a for a in attempts if a["outcome"] == "deferred"]
        assert tried and all(a["started_at"] < deadline for a in tried)
        shown = await pigeon_with(relay.config, "log", doomed)
        assert "deadline" in shown, shown
        await receiver.wait_for(
            lambda: any(
                e["type"] == "expired" and e["data"]["queue_id"] == doomed
                for e in receiver.events()
            )
        )
        [expired] = [e for e in receiver.events() if e["type"] == "expired"]
        assert expired["data"]["category"] == "deadline"

        # A bad value is refused with 422, naming the field; nothing is queued.
        status, problem = await api_send(relay, key, "x@dest.test", send_at="next week")
        assert status == 422 and "'send_at'" in problem["detail"], problem
    assert relay.exit_code == 0, relay.serve.output


def uuidof(text: str) -> uuid.UUID:
    return uuid.UUID(text)


async def wait_until_async(read: Any, value: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await read() == value:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not {value!r} within {timeout}s")
