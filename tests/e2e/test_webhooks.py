"""Webhooks from the real `pigeon-mta serve` (engine only) to real aiohttp receivers.

test --SQL--> PostgreSQL <--claim/record-- pigeon-mta serve --SMTP--> sink 127.0.0.2 (in the test)
                                                 \\--HTTP POST--> WebhookReceiver(s) 127.0.0.1
"""

from __future__ import annotations

import asyncio
import collections
import json
import tomllib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.conftest import free_port, run_pigeon
from tests.e2e.serve_process import ServeProcess
from tests.e2e.test_outbound_engine import engine_config, start_engine, stop
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers
from tests.peers.webhook_receiver import WebhookReceiver


@pytest.fixture
async def sink() -> AsyncIterator[tuple[SinkState, int]]:
    state = SinkState(slow_seconds=1.0)
    server = await start_sink(state, "127.0.0.2")
    try:
        yield state, server.sockets[0].getsockname()[1]
    finally:
        await stop_servers([server])


class Endpoints:
    """The webhook receivers a test starts, each registered for org `acme`; stopped at the end."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.started: list[WebhookReceiver] = []

    async def add(
        self, *events: str, listening: bool = True, **receiver: Any
    ) -> tuple[WebhookReceiver, str]:
        """A receiver (WebhookReceiver's keyword arguments; `listening=False`: a port nothing
        listens on yet) registered for `events` (default: all): (receiver, webhook id). The
        receiver knows the webhook's secret and checks every signature with it."""
        endpoint = WebhookReceiver(**receiver)
        self.started.append(endpoint)
        if listening:
            await endpoint.start()
        else:
            endpoint.port = free_port()
        extra = ("--events", ",".join(events)) if events else ()
        webhook_id, endpoint.secret = add_webhook(self.db_url, "acme", endpoint.url, *extra)
        return endpoint, webhook_id


@pytest.fixture
async def endpoints(db_url: str) -> AsyncIterator[Endpoints]:
    added = Endpoints(db_url)
    try:
        yield added
    finally:
        for receiver in added.started:
            await receiver.stop()


def add_webhook(db_url: str, org: str, url: str, *extra: str) -> tuple[str, str]:
    """`pigeon-mta webhook add ORG URL --json`: (id, secret)."""
    result = run_pigeon(
        "webhook", "add", org, url, *extra, "--json", env={"PIGEON_DATABASE_URL": db_url}
    )
    assert result.returncode == 0, result.stderr
    added = json.loads(result.stdout)
    return added["id"], added["secret"]


async def queue_mail(pool: asyncpg.Pool, org_id: uuid.UUID, addresses: list[str]) -> list[str]:
    """One message per address, each with its own Message-ID header; their queue ids."""
    ids = []
    for address in addresses:
        message_id = uuid.uuid4()
        ids.append(str(message_id))
        await pool.execute(
            """
            WITH m AS (
                INSERT INTO message (id, org_id, sender, size, body, listener, header_message_id)
                VALUES ($1, $2, 'sender@example.com', 30,
                        convert_to('Message-ID: <' || $4 || '>' || E'\\r\\nSubject: t\\r\\n\\r\\nbody\\r\\n', 'UTF8'),
                        'test', $4)
            )
            INSERT INTO recipient (id, message_id, org_id, address, domain, created_at,
                                   next_attempt_at)
            VALUES (gen_random_uuid(), $1, $2, $3, 'dest.test', now(), now())
            """,
            message_id,
            org_id,
            address,
            f"{message_id.hex}@app.test",
        )
    await pool.execute("SELECT pg_notify('pigeon_queue', '')")
    return ids


async def new_org(pool: asyncpg.Pool, name: str) -> uuid.UUID:
    from pigeon_mta.store.orgs import ensure_org

    return await ensure_org(pool, name)


def webhook_config(**keys: str) -> str:
    """A [webhooks] section after engine_config's [delivery] keys."""
    body = "\n".join(f'{k} = "{v}"' if not v.isdigit() else f"{k} = {v}" for k, v in keys.items())
    return f'\n[webhooks]\npoll_interval = "200ms"\n{body}\n'


async def wait_db(pool: asyncpg.Pool, query: str, *args: Any, timeout: float = 60) -> None:
    """Wait until `query` returns true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await pool.fetchval(query, *args):
        if loop.time() > deadline:
            raise AssertionError(f"not true within {timeout}s: {query}")
        await asyncio.sleep(0.1)


async def metric(tmp_path: Path, line_start: str) -> str | None:
    """The line of serve's /metrics (the port engine_config chose) that starts so, if any."""
    config = tomllib.loads((tmp_path / "pigeon.toml").read_text())
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{config['metrics']['listen']}/metrics") as reply,
    ):
        text = await reply.text()
    return next((line for line in text.splitlines() if line.startswith(line_start)), None)


async def test_delivered_deferred_and_bounced_events_arrive_signed(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    receiver, _id = await endpoints.add()
    serve = await start_engine(tmp_path, db_url, "node-a", port, delivery=webhook_config())
    try:
        ok, temp, bad = await queue_mail(
            pool, org_id, ["ok@dest.test", "tempfail@dest.test", "reject-rcpt@dest.test"]
        )

        def seen() -> set[tuple[str, str]]:
            return {(e["type"], e["data"]["recipient"]) for e in receiver.events()}

        await receiver.wait_for(
            lambda: (
                {
                    ("delivered", "ok@dest.test"),
                    ("deferred", "tempfail@dest.test"),
                    ("delivered", "tempfail@dest.test"),
                    ("bounced", "reject-rcpt@dest.test"),
                }
                <= seen()
            )
        )
    finally:
        assert await stop(serve) == 0, serve.output
    # Every request verifies with the independent verifier, and carries what the issue lists.
    assert receiver.requests and all(r.verified for r in receiver.requests)
    by_recipient = {(e["type"], e["data"]["recipient"]): e for e in receiver.events()}
    bounced = by_recipient[("bounced", "reject-rcpt@dest.test")]
    assert bounced["data"]["queue_id"] == bad
    assert bounced["data"]["message_id"] == f"{uuid.UUID(bad).hex}@app.test"
    assert bounced["data"]["code"] == 550 and bounced["data"]["enhanced_code"] == "5.1.1"
    assert bounced["data"]["category"] and bounced["data"]["attempt"] == 1
    assert bounced["timestamp"].endswith("Z")
    deferred = by_recipient[("deferred", "tempfail@dest.test")]
    assert deferred["data"]["queue_id"] == temp and deferred["data"]["code"] == 451
    delivered = by_recipient[("delivered", "ok@dest.test")]
    assert delivered["data"]["queue_id"] == ok and delivered["data"]["code"] == 250
    assert set(delivered["data"]) >= {
        "queue_id", "recipient", "message_id", "code", "enhanced_code", "response", "category",
        "attempt",
    }  # fmt: skip
    # The webhook-id is the event's id in the outbox, each event delivered.
    rows = await pool.fetch("SELECT id::text, state FROM webhook_event")
    assert {r["id"] for r in rows} == {r.webhook_id for r in receiver.requests}


async def test_an_org_without_webhooks_writes_no_webhook_events(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    receiver, _id = await endpoints.add("bounced")
    quiet = await new_org(pool, "quiet")
    serve = await start_engine(tmp_path, db_url, "node-a", port, delivery=webhook_config())
    try:
        await queue_mail(pool, quiet, ["ok@dest.test", "reject-rcpt@dest.test"])
        await queue_mail(pool, org_id, ["ok@dest.test", "reject-rcpt@dest.test"])
        await wait_db(
            pool,
            # (the bounces' DSNs to sender@example.com are mail of their own)
            "SELECT count(*) = 4 FROM recipient "
            "WHERE domain = 'dest.test' AND status IN ('delivered', 'bounced')",
        )
        await receiver.wait_for(lambda: len(receiver.requests) >= 1)
    finally:
        assert await stop(serve) == 0, serve.output
    # acme's one bounce is its only event (it asked for bounces only); quiet wrote none.
    rows = await pool.fetch("SELECT type, payload FROM webhook_event")
    assert [(r["type"], json.loads(r["payload"])["data"]["recipient"]) for r in rows] == [
        ("bounced", "reject-rcpt@dest.test")
    ]


async def test_a_receiver_down_for_a_while_gets_every_event_once_back(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    receiver, _id = await endpoints.add(listening=False)
    config = webhook_config(retry_initial="300ms", retry_max="1s", max_age="10m")
    serve = await start_engine(tmp_path, db_url, "node-a", port, delivery=config)
    try:
        await queue_mail(pool, org_id, [f"user{i}@dest.test" for i in range(5)])
        # Every event has been refused a connection at least twice.
        await wait_db(
            pool,
            "SELECT count(*) = 5 AND min(attempts) >= 2 FROM webhook_event WHERE state = 'pending'",
        )
        await receiver.start(receiver.port)
        await wait_db(pool, "SELECT bool_and(state = 'delivered') FROM webhook_event")
    finally:
        assert await stop(serve) == 0, serve.output
    assert len(receiver.requests) == 5 and all(r.verified for r in receiver.requests)
    assert sorted(e["data"]["recipient"] for e in receiver.events()) == [
        f"user{i}@dest.test" for i in range(5)
    ]


async def test_an_endpoint_that_always_answers_500_ends_failed_after_max_age(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    receiver, webhook_id = await endpoints.add(answer="fail")
    config = webhook_config(retry_initial="200ms", retry_max="500ms", max_age="3s")
    serve = await start_engine(tmp_path, db_url, "node-a", port, delivery=config)
    try:
        await queue_mail(pool, org_id, ["ok@dest.test"])
        await wait_db(pool, "SELECT bool_and(state = 'failed') FROM webhook_event")
        failed = await metric(tmp_path, 'pigeon_webhook_deliveries_total{outcome="failed"}')
        retried = await metric(tmp_path, 'pigeon_webhook_deliveries_total{outcome="retried"}')
    finally:
        assert await stop(serve) == 0, serve.output
    event = await pool.fetchrow("SELECT id::text, attempts, last_status FROM webhook_event")
    assert event is not None and event["last_status"] == 500 and event["attempts"] >= 2
    # Every try was the same event, signed each time.
    assert {r.webhook_id for r in receiver.requests} == {event["id"]}
    assert len(receiver.requests) == event["attempts"] and all(
        r.verified for r in receiver.requests
    )
    listed = run_pigeon("webhook", "list", "--json", env={"PIGEON_DATABASE_URL": db_url})
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["id"], row["failed"], row["backlog"], row["last_status"]) == (
        webhook_id, 1, 0, 500,
    )  # fmt: skip
    assert "webhook" in serve.output and "failed after" in serve.output
    assert failed is not None and failed.endswith(" 1.0")
    assert retried is not None and retried.endswith(f" {event['attempts'] - 1}.0")


async def test_a_stalled_receiver_holds_back_neither_mail_nor_another_endpoint(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    stalled, _id = await endpoints.add("delivered", answer="stall", stall_seconds=30)
    healthy, _id = await endpoints.add("delivered")
    config = webhook_config(concurrency_per_endpoint="2", timeout="60s")
    serve = await start_engine(tmp_path, db_url, "node-a", port, delivery=config)
    try:
        await queue_mail(pool, org_id, [f"user{i}@dest.test" for i in range(20)])
        await wait_db(pool, "SELECT count(*) = 20 FROM recipient WHERE status = 'delivered'")
        await healthy.wait_for(lambda: len(healthy.requests) == 20)
        # The stalled endpoint holds its two slots, no more, and has answered nothing.
        assert stalled.in_flight == 2 and stalled.max_in_flight == 2 and not stalled.requests
        # Its events wait, as the supervisor's stats round reports (every 5s).
        for _ in range(150):
            backlog = await metric(tmp_path, "pigeon_webhook_backlog ")
            if backlog == "pigeon_webhook_backlog 20.0":
                break
            await asyncio.sleep(0.1)
        assert backlog == "pigeon_webhook_backlog 20.0"
    finally:
        await stalled.stop()  # its requests end now, unanswered
        assert await stop(serve) == 0, serve.output
    assert all(r.verified for r in healthy.requests)
    # The stalled endpoint's events are all still waiting (none lost, none given up).
    pending = await pool.fetchval(
        "SELECT count(*) FROM webhook_event e JOIN webhook w ON w.id = e.webhook_id "
        "WHERE w.url = $1 AND e.state = 'pending'",
        stalled.url,
    )
    assert pending == 20


@pytest.mark.slow
async def test_kill_9_of_serve_mid_flow_loses_no_event(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    receiver, _id = await endpoints.add("delivered", answer="stall", stall_seconds=0.3)
    # Short request timeout: after the kill, the claims' leases (timeout + 10s) decide when the
    # events in flight are sent again.
    config = webhook_config(concurrency_per_endpoint="2", timeout="1s")
    addresses = [f"user{i}@dest.test" for i in range(30)]
    first: ServeProcess = await start_engine(
        tmp_path / "a", db_url, "node-a", port, delivery=config
    )
    try:
        await queue_mail(pool, org_id, addresses)
        await receiver.wait_for(lambda: len(receiver.requests) >= 3)
    finally:
        first.kill()
    second = await start_engine(tmp_path / "b", db_url, "node-b", port, delivery=config)
    try:
        await wait_db(
            pool,
            "SELECT count(*) = 30 AND bool_and(state = 'delivered') FROM webhook_event",
            timeout=120,
        )
    finally:
        assert await stop(second) == 0, second.output
    # Every recipient's delivered event arrived at least once; repeats share their webhook-id.
    got = collections.defaultdict(set)
    for request in receiver.requests:
        got[request.event["data"]["recipient"]].add(request.webhook_id)
    assert sorted(got) == sorted(addresses)
    assert all(len(ids) == 1 for ids in got.values())


async def test_sigterm_hands_back_the_events_of_stalled_requests_at_once(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    stalled, _id = await endpoints.add("delivered", answer="stall", stall_seconds=30)
    config = webhook_config(timeout="60s")
    serve = await start_engine(tmp_path, db_url, "node-a", port, delivery=config)
    try:
        await queue_mail(pool, org_id, ["a@dest.test", "b@dest.test"])
        await stalled.wait_for(lambda: stalled.in_flight == 2)
    finally:
        # serve's shutdown_timeout is 3s: the requests are given up then, not after 60s.
        assert await stop(serve) == 0, serve.output
    rows = await pool.fetch(
        "SELECT state, attempts, next_attempt_at <= now() AS due FROM webhook_event"
    )
    assert [tuple(r) for r in rows] == [("pending", 0, True)] * 2


async def test_two_worker_processes_send_each_event_once_and_count_together(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sink: tuple[SinkState, int],
    endpoints: Endpoints,
) -> None:
    _state, port = sink
    receiver, _id = await endpoints.add("delivered")
    path = engine_config(tmp_path, db_url, "node-a", port, delivery=webhook_config())
    path.write_text(path.read_text().replace("processes = 1\n", "processes = 2\n"))
    serve = ServeProcess("--config", str(path))
    try:
        await asyncio.to_thread(serve.wait_for, "delivery engine started", 60)
        await queue_mail(pool, org_id, [f"user{i}@dest.test" for i in range(40)])
        await wait_db(
            pool, "SELECT count(*) = 40 AND bool_and(state = 'delivered') FROM webhook_event"
        )
        delivered = await metric(tmp_path, 'pigeon_webhook_deliveries_total{outcome="delivered"}')
    finally:
        assert await stop(serve) == 0, serve.output
    ids = [r.webhook_id for r in receiver.requests]
    assert len(ids) == len(set(ids)) == 40 and all(r.verified for r in receiver.requests)
    assert delivered == 'pigeon_webhook_deliveries_total{outcome="delivered"} 40.0'
