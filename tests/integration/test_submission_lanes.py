"""Lanes at reception: the X-Pigeon-Lane field, the AUTH user's lane, the listener's, the default.

smtplib clients (127.0.0.1) ──SMTP──► relay / submission listeners ──► PostgreSQL
                                                                          │
                                  DeliveryEngine ──DNS──► DnsServer, ──SMTP──► sinks (127.0.0.2)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from pathlib import Path

import asyncpg
import pytest
from prometheus_client import REGISTRY

from pigeon_mta.config import LaneSettings, Settings, default_lanes
from pigeon_mta.ids import new_id
from pigeon_mta.model import Envelope
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.store.duplicates import enqueue_submitted
from tests.integration.outbound_helpers import running_engine, wait_final
from tests.integration.submission_helpers import (
    add_user,
    counts,
    make_settings,
    message,
    queue_id_of,
    running_service,
    smtp_client,
)
from tests.peers.world import mail_world

SENDER = "app@acme.example"


def with_lanes(settings: Settings, *, listener_lane: str = "") -> Settings:
    """The built-in lanes and "notify"; every listener's lane is `listener_lane`."""
    lanes = {**default_lanes(), "notify": LaneSettings(weight=5)}
    listeners = tuple(dataclasses.replace(x, lane=listener_lane) for x in settings.listener)
    return dataclasses.replace(settings, lanes=lanes, listener=listeners)


def send(
    port: int, data: bytes, *, login: tuple[str, str] | None = None, to: str = "bob@plain.test"
) -> tuple[int, bytes]:
    """One message; the reply to its DATA."""
    with smtp_client(port) as client:
        client.ehlo()
        if login:
            client.login(*login)
        client.mail(SENDER)
        code, reply = client.rcpt(to)
        assert code == 250, reply
        return client.data(data)


def with_fields(*fields: str) -> bytes:
    head = "".join(f"{f}\r\n" for f in fields)
    return head.encode() + message(SENDER, "bob@plain.test", "Your password reset")


async def lanes_of(pool: asyncpg.Pool, queue_id: uuid.UUID) -> tuple[str, set[str]]:
    """The message's lane and its recipients' lanes."""
    lane = await pool.fetchval("SELECT lane FROM message WHERE id = $1", queue_id)
    rows = await pool.fetch("SELECT lane FROM recipient WHERE message_id = $1", queue_id)
    return lane, {r["lane"] for r in rows}


def rejected(reason: str, listener: str = "relay") -> float:
    labels = {"listener": listener, "reason": reason}
    return REGISTRY.get_sample_value("pigeon_smtp_rejections_total", labels) or 0.0


async def test_the_field_picks_the_lane_and_is_never_delivered(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    async with mail_world(tmp_path) as world:
        relay = with_lanes(make_settings(tmp_path, db_url, None, modes=("relay",)))
        engine = dataclasses.replace(world.settings(db_url), lanes=relay.lanes)
        data = with_fields("X-Pigeon-Lane:  Bulk ")
        async with running_service(relay, pool) as running:
            code, reply = await asyncio.to_thread(send, running.port("relay"), data)
        assert code == 250, reply
        queue_id = queue_id_of(reply)
        assert await lanes_of(pool, queue_id) == ("bulk", {"bulk"})
        stored = bytes(await pool.fetchval("SELECT body FROM message WHERE id = $1", queue_id))
        assert b"x-pigeon-lane" not in stored.lower()
        assert b"Subject: Your password reset" in stored

        async with running_engine(engine, pool, db_url):
            assert await wait_final(pool, queue_id) == {"bob@plain.test": "delivered"}
        [received] = world.sinks.received_by("bob@plain.test")
        assert b"x-pigeon-lane" not in received.data.lower()
        assert b"Subject: Your password reset" in received.data


async def test_an_unknown_lane_gets_550_and_nothing_is_queued(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    settings = with_lanes(make_settings(tmp_path, db_url, None, modes=("relay",)))
    before = rejected("bad_lane")
    async with running_service(settings, pool) as running:
        port = running.port("relay")
        typo = await asyncio.to_thread(send, port, with_fields("X-Pigeon-Lane: bluk"))
        disagree = await asyncio.to_thread(
            send, port, with_fields("X-Pigeon-Lane: bulk", "X-Pigeon-Lane: notify")
        )
        assert await counts(pool) == (0, 0)
        # The same lane twice, and an empty field beside it, name one lane.
        agree = await asyncio.to_thread(
            send, port, with_fields("X-Pigeon-Lane: bulk", "X-Pigeon-Lane: BULK", "X-Pigeon-Lane:")
        )
        empty = await asyncio.to_thread(send, port, with_fields("X-Pigeon-Lane: "))
    assert typo == (550, b"5.7.0 X-Pigeon-Lane: no such lane: bluk")
    assert disagree == (550, b"5.7.0 X-Pigeon-Lane fields name different lanes: bulk, notify")
    assert rejected("bad_lane") == before + 2
    assert agree[0] == 250 and empty[0] == 250
    assert await lanes_of(pool, queue_id_of(agree[1])) == ("bulk", {"bulk"})
    assert await lanes_of(pool, queue_id_of(empty[1])) == ("transactional", {"transactional"})
    assert await counts(pool) == (2, 2)


@pytest.mark.parametrize(
    ("header", "higher_field", "lower_field", "relay_field"),
    [
        ("lower", "notify", "bulk", "bulk"),  # the default: only to a lane of no more weight
        ("any", "transactional", "bulk", "bulk"),
        ("off", "notify", "notify", "transactional"),
    ],
)
async def test_the_operators_lane_then_the_field_as_lanes_header_allows(
    tmp_path: Path,
    db_url: str,
    pool: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
    header: str,
    higher_field: str,
    lower_field: str,
    relay_field: str,
) -> None:
    """The user's lane, else the listener's, else the default; X-Pigeon-Lane moves a message
    from it as `[lanes] header` says: a `notify` user (weight 5) asking for `transactional`
    (10) or `bulk` (1), and relay mail (transactional) asking for `bulk`."""
    base = make_settings(tmp_path, db_url, None, modes=("relay", "submission"), plaintext_auth=True)
    settings = dataclasses.replace(with_lanes(base), lane_header=header)
    submission = dataclasses.replace(settings.listener[1], lane="bulk")
    settings = dataclasses.replace(settings, listener=(settings.listener[0], submission))
    notify = await add_user(pool, "notify-app")
    plain = await add_user(pool, "plain-app", domains=())
    stale = await add_user(pool, "stale-app", domains=())
    await store_credentials.set_lane(pool, "notify-app", "notify")
    # A lane the settings no longer have (they changed after `user set`).
    # (a lane name of its own per case: the warning comes once per user, lane and process)
    retired = f"retired-{header}"
    await store_credentials.set_lane(pool, "stale-app", retired)
    caplog.set_level(logging.WARNING, "pigeon_mta.submission")

    async with running_service(settings, pool) as running:
        sub, relay = running.port("submission"), running.port("relay")

        def lane_of_send(port: int, data: bytes, login: tuple[str, str] | None = None) -> uuid.UUID:
            code, reply = send(port, data, login=login)
            assert code == 250, reply
            return queue_id_of(reply)

        plain_message = message(SENDER, "bob@plain.test")
        cases = {
            "user": (sub, plain_message, (notify.username, notify.password)),
            "higher field over user": (
                sub,
                with_fields("X-Pigeon-Lane: transactional"),
                (notify.username, notify.password),
            ),
            "lower field over user": (
                sub,
                with_fields("X-Pigeon-Lane: bulk"),
                (notify.username, notify.password),
            ),
            "field over default": (relay, with_fields("X-Pigeon-Lane: bulk"), None),
            "listener": (sub, plain_message, (plain.username, plain.password)),
            "stale user lane": (sub, plain_message, (stale.username, stale.password)),
            "default": (relay, plain_message, None),
        }
        got = {}
        for name, (port, data, login) in cases.items():
            queue_id = await asyncio.to_thread(lane_of_send, port, data, login)
            got[name] = (await lanes_of(pool, queue_id))[0]
    assert got == {
        "user": "notify",
        "higher field over user": higher_field,
        "lower field over user": lower_field,
        "field over default": relay_field,
        "listener": "bulk",
        "stale user lane": "bulk",
        "default": "transactional",
    }
    warnings = [r.getMessage() for r in caplog.records if retired in r.getMessage()]
    assert len(warnings) == 1 and "stale-app" in warnings[0]


async def test_a_user_lane_set_later_holds_from_the_next_auth(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    settings = with_lanes(
        make_settings(tmp_path, db_url, None, modes=("submission",), plaintext_auth=True)
    )
    user = await add_user(pool)
    login = (user.username, user.password)
    data = message(SENDER, "bob@plain.test")
    async with running_service(settings, pool) as running:
        port = running.port("submission")
        first = await asyncio.to_thread(send, port, data, login=login)
        await store_credentials.set_lane(pool, user.username, "bulk")
        second = await asyncio.to_thread(send, port, data, login=login)
    assert (await lanes_of(pool, queue_id_of(first[1])))[0] == "transactional"
    assert (await lanes_of(pool, queue_id_of(second[1])))[0] == "bulk"


async def test_every_enqueue_statement_stores_the_lane(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """One message and a group commit's batch, with and without the duplicate check."""

    def envelope(lane: str, message_id: str | None) -> Envelope:
        return Envelope(
            org_id=org_id,
            sender=SENDER,
            recipients=("a@plain.test", "b@plain.test"),
            body=message(SENDER, "a@plain.test"),
            listener="test",
            header_message_id=message_id,
            duplicate_window=3600.0 if message_id else 0.0,
            lane=lane,
        )

    cases = {
        "one": [envelope("bulk", None)],
        "one, checked for duplicates": [envelope("notify", "one@acme.example")],
        "batch": [envelope("bulk", None), envelope("notify", None)],
        "batch, checked": [envelope("notify", "b1@acme.example"), envelope("bulk", None)],
    }
    for name, envelopes in cases.items():
        batch = [(new_id(), e) for e in envelopes]
        assert (await enqueue_submitted(pool, batch)).duplicates == {}, name
        for queue_id, e in batch:
            assert await lanes_of(pool, queue_id) == (e.lane, {e.lane}), name
