"""Delivery records are stamped when the receiver answered the final dot, in the delivery log and
in `pigeon-mta log --json` alike.

engine --SMTP--> 127.0.0.2 sink (mx.plain.test): each reply to a final dot waits a second, and
                 the destination takes one transaction at a time, so the second message waits its
                 turn after it was claimed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from pigeon_mta.config import DestinationSettings
from pigeon_mta.delivery_log import DeliveryLog
from tests.conftest import run_pigeon
from tests.integration.outbound_helpers import running_engine, send, wait_final
from tests.peers.world import mail_world


def _when(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


async def pigeon_log_json(db_url: str, queue_id: uuid.UUID) -> list[dict[str, Any]]:
    result = await asyncio.to_thread(
        run_pigeon,
        "log",
        str(queue_id),
        "--json",
        env={"PIGEON_DATABASE_URL": db_url, "PIGEON_CONFIG": ""},
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


async def test_a_delivery_is_stamped_after_the_receiver_answered(
    tmp_path: Path, pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    log_path = tmp_path / "delivery.log"
    delivery_log = DeliveryLog.open(str(log_path))
    async with mail_world(tmp_path) as world:
        settings = world.settings(
            db_url, destination={"plain.test": DestinationSettings(concurrency=1)}
        )
        async with running_engine(settings, pool, db_url, delivery_log=delivery_log):
            queue_ids = [
                await send(pool, org_id, "slow+1@plain.test"),
                await send(pool, org_id, "slow+2@plain.test"),
            ]
            for queue_id in queue_ids:
                assert set((await wait_final(pool, queue_id)).values()) == {"delivered"}
        replied = {m.rcpt_tos[0]: m.replied_at for m in world.sinks.messages}
    delivery_log.close()

    written = [json.loads(line) for line in log_path.read_text().splitlines()]
    stored = [r for q in queue_ids for r in await pigeon_log_json(db_url, q)]
    for records in (written, stored):
        deliveries = [r for r in records if r["type"] == "Delivery"]
        assert len(deliveries) == 2
        for record in deliveries:
            answered = replied[record["recipient"]]
            assert answered is not None
            assert _when(record) >= answered, (record["recipient"], record["timestamp"])
