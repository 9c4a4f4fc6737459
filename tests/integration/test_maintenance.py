"""The supervisor's queue maintenance against a real PostgreSQL: what it owes the delivery log."""

from __future__ import annotations

import dataclasses
import uuid

import asyncpg

from pigeon_mta.app import Maintenance
from pigeon_mta.config import DeliverySettings, Duration, Settings
from pigeon_mta.store.queue import ExpiredRecipient
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
