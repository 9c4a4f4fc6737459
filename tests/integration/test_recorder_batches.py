"""The engine's recorder on a real PostgreSQL: results that finish within `delivery.record_wait`
of each other are recorded together, one statement and one commit per batch, also while results
keep coming during a record."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import asyncpg

from pigeon_mta.config import DeliverySettings, Duration, Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.model import Outcome
from pigeon_mta.outbound.claims import Claims
from pigeon_mta.outbound.recorder import Recorder
from tests.integration.queue_helpers import bulk_queue, claim, results_for

OWNER = "node-a"


async def test_results_arriving_steadily_are_recorded_once_per_record_wait(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """240 results, one every 5 ms (1.2 s), with record_wait 0.3 s: each batch waits for the
    results of 0.3 s after its oldest one, so at most 1.2 / 0.3 + 1 batches (and one more for
    timing slack). Recorded at once when they came during a record, the results made a batch
    of one or two after each (12 batches, measured)."""
    await bulk_queue(pool, org_id, messages=240)
    deliveries = await claim(pool, owner=OWNER, lease=300, batch=240)
    results = results_for(deliveries, Outcome.DELIVERED)
    assert len(results) == 240
    settings = dataclasses.replace(Settings(), delivery=DeliverySettings(record_wait=Duration(0.3)))
    claims = Claims(pool, owner=OWNER, lease=300)
    claims.hold(deliveries, asyncio.get_running_loop().time())
    recorder = Recorder(pool, settings, claims, DeliveryLog.open(""))
    running = asyncio.create_task(recorder.run())
    try:
        for result in results:
            recorder.submit([result])
            await asyncio.sleep(0.005)
    finally:
        recorder.finish()
        await asyncio.wait_for(running, 30)

    batches = await pool.fetchval("SELECT count(DISTINCT recorded_at) FROM attempt")
    assert await pool.fetchval("SELECT count(*) FROM attempt WHERE applied") == 240
    assert 3 <= batches <= 6, batches
    assert len(claims) == 0
