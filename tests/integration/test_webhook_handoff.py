"""A worker's webhook sender takes the events of its process's recorded outcomes from the record
itself (webhooks/sender.py `offer` and `take`, store/outcomes.py `record_outcomes`): a real sender,
a real PostgreSQL and a real aiohttp receiver on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Literal

import asyncpg
import pytest

from pigeon_mta.config import Duration, Settings, WebhookSettings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.model import AttemptResult, Outcome, Reply
from pigeon_mta.outbound.claims import Claims
from pigeon_mta.outbound.recorder import Recorder
from pigeon_mta.store import outcomes
from pigeon_mta.store import webhooks as store_webhooks
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.webhooks.sender import RecordInterrupted, WebhookSender, record_results
from pigeon_mta.webhooks.signing import new_secret
from tests.integration.queue_helpers import record_attempts
from tests.integration.test_bounces import claim_all, result
from tests.integration.test_webhook_outbox import send
from tests.peers.webhook_receiver import WebhookReceiver

OK = Reply(250, "2.0.0", "ok")


@pytest.fixture
async def receiver() -> AsyncIterator[WebhookReceiver]:
    started = WebhookReceiver(secret=new_secret())
    await started.start()
    try:
        yield started
    finally:
        await started.stop()


@pytest.fixture
async def sender(pool: asyncpg.Pool) -> AsyncIterator[WebhookSender]:
    """A sender that looks in the outbox once when it starts and then once a day, unless a
    record leaves events there; it sends 2 requests at once to an endpoint."""
    settings = WebhookSettings(poll_interval=Duration(86400), concurrency_per_endpoint=2)
    started = WebhookSender(settings, pool)
    await started.start()
    try:
        yield started
    finally:
        loop = asyncio.get_running_loop()
        await started.stop(loop.time() + 5)


async def offered(sender: WebhookSender) -> store_webhooks.Offer:
    """The sender's offer, once its first claim (at start) is over: while a claim holds the
    room, an offer is none after OFFER_WAIT."""
    for _ in range(100):
        offer = await sender.offer()
        if offer is not store_webhooks.NO_OFFER:
            return offer
    raise AssertionError("the sender offered no room in 100 tries")


async def delivered(pool: asyncpg.Pool, org_id: uuid.UUID, count: int) -> list[AttemptResult]:
    addresses = [f"r{n}@example.net" for n in range(count)]
    await send(pool, org_id, *addresses)
    [delivery] = await claim_all(pool)
    return [result(delivery, a, Outcome.DELIVERED, OK) for a in addresses]


async def test_events_handed_over_by_the_record_are_sent_and_recorded(
    pool: asyncpg.Pool, org_id: uuid.UUID, sender: WebhookSender, receiver: WebhookReceiver
) -> None:
    """The events within the offer reach the receiver signed, though the sender will not look
    in the outbox for a day; the one beyond its room (2) is claimed once a slot is free."""
    assert receiver.secret is not None
    hook = await store_webhooks.add_webhook(
        pool, org_id, receiver.url, ["delivered"], receiver.secret
    )
    results = await delivered(pool, org_id, 3)
    offer = await offered(sender)
    assert (dict(offer.rooms), offer.other) == ({}, 2)
    # One record at a time holds the room: another one gets none once it has waited
    # OFFER_WAIT, and writes its events for any sender to claim.
    assert await sender.offer() is store_webhooks.NO_OFFER

    recorded = await outcomes.record_outcomes(pool, results, offer)
    sender.take(offer, recorded.events, recorded.waiting)

    assert (len(recorded.events), recorded.waiting) == (2, {hook.id})
    await receiver.wait_for(lambda: len(receiver.requests) == 3, timeout=30)
    assert all(r.verified for r in receiver.requests)
    event_ids = {str(r["id"]) for r in await pool.fetch("SELECT id FROM webhook_event")}
    assert {r.webhook_id for r in receiver.requests} == event_ids
    # The outcomes are recorded in the outbox: every event delivered, each sent once.
    for _ in range(100):
        states = await pool.fetch("SELECT state, attempts FROM webhook_event")
        if all(r["state"] == "delivered" for r in states):
            break
        await asyncio.sleep(0.05)
    assert sorted((r["state"], r["attempts"]) for r in states) == [("delivered", 1)] * 3


async def test_a_record_that_fails_gives_the_room_back(
    pool: asyncpg.Pool, org_id: uuid.UUID, sender: WebhookSender, receiver: WebhookReceiver
) -> None:
    assert receiver.secret is not None
    await store_webhooks.add_webhook(pool, org_id, receiver.url, ["delivered"], receiver.secret)
    offer = await offered(sender)
    sender.take(offer, [], set())  # what the recorder does when the record raised
    again = await offered(sender)
    assert again is not offer
    sender.take(again, [], set())


class CountingEvent(asyncio.Event):
    """The sender's wake-up event, counting how often its loop waits on it."""

    waits = 0

    async def wait(self) -> Literal[True]:
        self.waits += 1
        return await super().wait()


async def test_a_sender_waiting_for_a_records_take_does_not_spin(pool: asyncpg.Pool) -> None:
    """Its poll interval passes while a record holds the room: the claim waits for `take`, and
    the loop with it, instead of going round."""
    settings = WebhookSettings(poll_interval=Duration(0.05))
    sender = WebhookSender(settings, pool)
    wake = sender._wake = CountingEvent()
    await sender.start()
    try:
        offer = await offered(sender)
        rounds = wake.waits
        await asyncio.sleep(0.5)  # ten poll intervals
        during = wake.waits - rounds
        sender.take(offer, [], set())
    finally:
        await sender.stop(asyncio.get_running_loop().time() + 5)
    assert during <= 20, during


async def test_a_record_the_database_refuses_gives_the_room_back(
    db_url: str,
    admin_url: str,
    pool: asyncpg.Pool,
    org_id: uuid.UUID,
    sender: WebhookSender,
    receiver: WebhookReceiver,
) -> None:
    """The engine's recorder records while its database refuses connections (as one being
    restarted does): the record fails, the sender's room is free again at once, and the next
    record, once the database is back, hands the events over. (Killing the record's backend
    instead raced with asyncpg's pool, which replaces a connection it has seen close.)"""
    assert receiver.secret is not None
    await store_webhooks.add_webhook(pool, org_id, receiver.url, ["delivered"], receiver.secret)
    results = await delivered(pool, org_id, 2)
    sender.take(await offered(sender), [], set())  # the start-up claim is over
    name = db_url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(admin_url)
    record_pool = await asyncpg.create_pool(db_url, min_size=0, max_size=1)
    try:
        settings = Settings()
        claims = Claims(record_pool, owner="test", lease=60)
        recorder = Recorder(record_pool, settings, claims, DeliveryLog.open(""), sender)
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        with pytest.raises(DB_ERRORS):
            await recorder.record(results)
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

        again = await asyncio.wait_for(sender.offer(), 5)
        assert again is not store_webhooks.NO_OFFER
        sender.take(again, [], set())
        await recorder.record(results)  # the database is back
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
        await record_pool.close()
    await receiver.wait_for(lambda: len(receiver.requests) == 2, timeout=30)
    assert await pool.fetchval("SELECT count(*) FROM webhook_event") == 2


async def test_a_hostile_endpoints_reply_never_stops_the_senders_record(
    pool: asyncpg.Pool, org_id: uuid.UUID, receiver: WebhookReceiver
) -> None:
    """One endpoint answers 500 with a reason phrase of bytes that are not UTF-8 (aiohttp gives
    them as lone surrogates, which PostgreSQL refuses): its result is recorded with the reason
    made plain, and the other endpoint's events, recorded in the same batch, are delivered
    once. When the first stopped the batch's record, neither was recorded, and the sender
    looked in the outbox no more."""

    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 500 Bad \xff\xfe reason\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(hostile, "127.0.0.1", 0)
    bad_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hooks"
    assert receiver.secret is not None
    bad = await store_webhooks.add_webhook(pool, org_id, bad_url, ["delivered"], new_secret())
    good = await store_webhooks.add_webhook(
        pool, org_id, receiver.url, ["delivered"], receiver.secret
    )
    await record_attempts(pool, await delivered(pool, org_id, 3))
    settings = WebhookSettings(poll_interval=Duration(0.2), concurrency_per_endpoint=8)
    sender = WebhookSender(settings, pool)
    await sender.start()
    try:
        await receiver.wait_for(lambda: len(receiver.requests) >= 3, 30)
        for _ in range(100):
            states = await pool.fetch(
                "SELECT webhook_id, state, attempts, last_error FROM webhook_event"
            )
            if all(
                s["attempts"] == 1 and s["last_error"] for s in states if s["webhook_id"] == bad.id
            ) and all(s["state"] == "delivered" for s in states if s["webhook_id"] == good.id):
                break
            await asyncio.sleep(0.1)
    finally:
        await sender.stop(asyncio.get_running_loop().time() + 5)
        server.close()
        await server.wait_closed()
    for s in states:
        if s["webhook_id"] == good.id:
            assert s["state"] == "delivered"
        else:
            assert s["state"] == "pending" and s["attempts"] == 1
            assert s["last_error"] == "HTTP 500 Bad \\udcff\\udcfe reason"
    assert len(receiver.requests) == 3  # each once: recorded, not sent again after a lease


async def test_a_result_the_database_refuses_costs_that_result_not_the_record(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """Three claimed events' results, one with a status no integer column holds: the other two
    are recorded, the third is left to its lease (its event is sent again), and nothing raises.
    A database that is away interrupts the record with what it did not record."""
    await store_webhooks.add_webhook(pool, org_id, "http://127.0.0.1:9/h", ["delivered"], "s")
    await record_attempts(pool, await delivered(pool, org_id, 3))
    async with pool.acquire() as conn:
        claimed = await store_webhooks.claim_due_events(conn, room=8, busy={}, lease=60)
    later = datetime.now(UTC) + timedelta(seconds=60)
    results = [store_webhooks.EventResult(e, "pending", 500, "HTTP 500", later) for e in claimed]
    results[1] = dataclasses.replace(results[1], status=10**12)

    await record_results(pool, results)

    errors = {
        r["id"]: r["last_error"]
        for r in await pool.fetch("SELECT id, last_error FROM webhook_event")
    }
    assert errors[claimed[0].id] == errors[claimed[2].id] == "HTTP 500"
    assert errors[claimed[1].id] is None  # not recorded: due again when its lease runs out
    away = await asyncpg.create_pool("postgresql://nobody@127.0.0.1:1/none", min_size=0, max_size=1)
    try:
        with pytest.raises(RecordInterrupted) as interrupted:
            await record_results(away, results)
    finally:
        await away.close()
    assert interrupted.value.unrecorded == results
