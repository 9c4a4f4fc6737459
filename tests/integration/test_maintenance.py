"""The supervisor's queue maintenance against a real PostgreSQL: what it owes the delivery log."""

from __future__ import annotations

import dataclasses
import uuid

import asyncpg

from pigeon_mta.config import BounceSettings, DeliverySettings, Duration, Settings
from pigeon_mta.maintenance import Maintenance
from pigeon_mta.store.upkeep import ExpiredRecipient
from tests.integration.queue_helpers import bulk_queue


async def test_expiries_whose_log_records_could_not_be_read_are_logged_next_round(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A database blip while the Expiration records are read loses none of them: the next
    round hands over those and the new ones together."""
    settings = dataclasses.replace(
        Settings(), delivery=dataclasses.replace(DeliverySettings(), max_age=Duration(3600))
    )
    handed: list[list[ExpiredRecipient]] = []

    async def flaky_log(expired: list[ExpiredRecipient]) -> None:
        handed.append(list(expired))
        if len(handed) == 1:
            raise asyncpg.CannotConnectNowError("the database is starting up")

    maintenance = Maintenance(settings, pool, on_expired=flaky_log)
    await bulk_queue(pool, org_id, messages=3, age=7200, domain="old.example")
    try:
        await maintenance.sweep_once()
    except asyncpg.CannotConnectNowError:
        pass  # run() logs it and goes on; the records are kept
    await bulk_queue(pool, org_id, messages=2, age=7200, domain="older.example")
    await maintenance.sweep_once()
    await maintenance.sweep_once()  # nothing new, nothing owed: no call

    assert [len(batch) for batch in handed] == [3, 5]
    assert {e.recipient_id for e in handed[0]} <= {e.recipient_id for e in handed[1]}
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'expired'") == 5


async def test_delay_warnings_are_sent_only_when_configured(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """bounces.delay_warning_after = 0 (the default) sends none; set, the maintenance round
    queues them for recipients deferred longer than it."""
    await bulk_queue(pool, org_id, messages=2, recipients_per_message=2, age=7200, due_in=600)
    await pool.execute("UPDATE recipient SET attempts = 1")  # deferred after one try

    await Maintenance(Settings(), pool).sweep_once()
    assert await warnings_queued(pool) == 0

    settings = dataclasses.replace(
        Settings(),
        bounces=dataclasses.replace(BounceSettings(), delay_warning_after=Duration(3600)),
    )
    await Maintenance(settings, pool).sweep_once()
    assert await warnings_queued(pool) == 2  # one per message, to sender@example.com
    await Maintenance(settings, pool).sweep_once()
    assert await warnings_queued(pool) == 2


async def warnings_queued(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            """SELECT count(*) FROM message m JOIN recipient r ON r.message_id = m.id
               WHERE m.sender = '' AND r.address = 'sender@example.com'
                 AND position('Action: delayed'::bytea IN m.body) > 0"""
        )
    )
