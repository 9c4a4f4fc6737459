"""`pigeon-mta webhook add|list|remove|test`: the real command against a real database and a real
aiohttp receiver on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg

from tests.conftest import free_port, run_pigeon
from tests.e2e.shared import pigeon_json as pigeon
from tests.peers.webhook_receiver import WebhookReceiver


def failing(db_url: str, *args: str) -> str:
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


async def test_add_prints_the_secret_once_and_list_shows_the_endpoint(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    added = pigeon(db_url, "webhook", "add", "acme", "https://app.example/hooks")
    assert set(added) == {"id", "secret"} and added["secret"].startswith("whsec_")
    table = run_pigeon(
        "webhook", "add", "acme", "http://127.0.0.1:8080/x", "--events", "bounced,expired",
        env={"PIGEON_DATABASE_URL": db_url},
    )  # fmt: skip
    assert table.returncode == 0 and "whsec_" in table.stdout
    assert "shown only this once" in table.stderr

    listed = pigeon(db_url, "webhook", "list")
    assert (listed[0]["id"], listed[0]["url"], listed[0]["events"]) == (
        added["id"], "https://app.example/hooks",
        "delivered,deferred,bounced,expired,suppressed,complained,paused,resumed",
    )  # fmt: skip
    assert listed[1]["events"] == "bounced,expired"
    assert all(w["backlog"] == 0 and w["last_status"] is None for w in listed)
    assert all("secret" not in w and "whsec_" not in json.dumps(w) for w in listed)
    assert pigeon(db_url, "webhook", "list", "acme") == listed
    await pool.execute("INSERT INTO org (id, name) VALUES (gen_random_uuid(), 'other')")
    assert pigeon(db_url, "webhook", "list", "other") == []


async def test_complained_is_an_event_type_an_endpoint_may_take(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """`complained` is an event type an endpoint may take alone; an unknown one is refused with the
    types there are."""
    added = pigeon(
        db_url, "webhook", "add", "acme", "https://app.example/fbl", "--events", "complained"
    )
    stored = await pool.fetchval("SELECT events FROM webhook WHERE id = $1", uuid.UUID(added["id"]))
    assert stored == ["complained"]
    assert pigeon(db_url, "webhook", "list")[0]["events"] == "complained"
    refused = failing(db_url, "webhook", "add", "acme", "https://x.example/", "--events", "spam")
    assert refused.endswith("suppressed, complained, paused, resumed"), refused


async def test_remove_deletes_the_endpoint_and_its_events(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    added = pigeon(db_url, "webhook", "add", "acme", "https://app.example/hooks")
    await pool.execute(
        "INSERT INTO webhook_event (id, webhook_id, type, payload) "
        "VALUES (gen_random_uuid(), $1, 'delivered', '{}')",
        uuid.UUID(added["id"]),
    )
    assert pigeon(db_url, "webhook", "list")[0]["backlog"] == 1
    assert pigeon(db_url, "webhook", "remove", added["id"]) == {"id": added["id"], "removed": True}
    assert pigeon(db_url, "webhook", "list") == []
    assert await pool.fetchval("SELECT count(*) FROM webhook_event") == 0
    assert "there is no webhook" in failing(db_url, "webhook", "remove", added["id"])


async def test_test_sends_a_signed_ping_and_prints_the_reply_status(
    db_url: str, org_id: uuid.UUID
) -> None:
    receiver = WebhookReceiver()
    await receiver.start()
    failer = WebhookReceiver(answer="fail")
    await failer.start()
    try:
        added = pigeon(db_url, "webhook", "add", "acme", receiver.url)
        receiver.secret = added["secret"]
        result = await asyncio.to_thread(
            run_pigeon, "webhook", "test", added["id"], env={"PIGEON_DATABASE_URL": db_url}
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{receiver.url} answered 204"
        [ping] = receiver.requests
        assert ping.verified and ping.event["type"] == "ping"
        assert ping.event["data"]["webhook_id"] == added["id"]

        bad = pigeon(db_url, "webhook", "add", "acme", failer.url)
        result = await asyncio.to_thread(
            run_pigeon, "webhook", "test", bad["id"], env={"PIGEON_DATABASE_URL": db_url}
        )
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stdout.strip() == f"{failer.url} answered 500"
        assert "the ping was not accepted: HTTP 500" in result.stderr
    finally:
        await receiver.stop()
        await failer.stop()
    # The last reply of each is what `webhook list` shows.
    listed = {w["id"]: w for w in pigeon(db_url, "webhook", "list")}
    assert listed[added["id"]]["last_status"] == 204
    assert listed[bad["id"]]["last_status"] == 500
    down = pigeon(db_url, "webhook", "add", "acme", f"http://127.0.0.1:{free_port()}/x")
    result = run_pigeon("webhook", "test", down["id"], env={"PIGEON_DATABASE_URL": db_url})
    assert result.returncode == 1 and result.stdout.strip().endswith(": no reply")
    assert "the ping was not accepted: ClientConnectorError" in result.stderr


def test_bad_input_gets_one_sentence(db_url: str, org_id: uuid.UUID) -> None:
    cases = {
        ("webhook", "add", "nosuch", "https://x.example/"): "there is no org named 'nosuch'",
        ("webhook", "add", "acme", "ftp://x.example/"): "is not an http:// or https:// URL",
        ("webhook", "add", "acme", "https://"): "is not an http:// or https:// URL",
        ("webhook", "add", "acme", "http://x:port/"): "is not a URL",
        ("webhook", "add", "acme", "https://x.example/", "--events", "opened"): (
            "unknown event type(s) opened"
        ),
        ("webhook", "remove", "not-an-id"): "'not-an-id' is not a webhook id",
        ("webhook", "test", str(uuid.uuid4())): "there is no webhook",
        ("webhook", "list", "nosuch"): "there is no org named 'nosuch'",
    }
    for args, expected in cases.items():
        assert expected in failing(db_url, *args), args
