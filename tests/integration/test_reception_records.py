"""Reception records: the delivery log and `pigeon-mta log --json` tell the same story of a message
received over STARTTLS, down to the microsecond.

smtplib client 127.0.0.1 --STARTTLS--> relay listener (test CA certificate) --> PostgreSQL
                                             |--> delivery log file
pigeon-mta log QUEUE_ID --json  <-- PostgreSQL
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.intake.accept import Intake
from pigeon_mta.submission.service import SubmissionService
from tests.conftest import run_pigeon
from tests.integration.submission_helpers import (
    make_settings,
    make_tls,
    message,
    queue_id_of,
    smtp_client,
)


async def receive_over_starttls(tmp_path: Path, pool: asyncpg.Pool, db_url: str) -> uuid.UUID:
    tls = make_tls(tmp_path)
    settings = make_settings(tmp_path, db_url, tls, modes=("relay",))
    delivery_log = DeliveryLog.open(str(tmp_path / "delivery.log"))
    service = SubmissionService(
        settings, pool, Intake.of(settings, pool, delivery_log=delivery_log)
    )
    await service.start()

    def send() -> str:
        with smtp_client(service.bound["relay"][1]) as client:
            client.starttls(context=tls.client_context())
            client.ehlo("client.test")
            client.mail("app@internal.test")
            client.rcpt("bob@example.net")
            code, reply = client.data(message("app@internal.test", "bob@example.net"))
            assert code == 250, reply
            return reply.decode()

    try:
        return queue_id_of(await asyncio.to_thread(send))
    finally:
        await service.stop(asyncio.get_running_loop().time() + 5)
        delivery_log.close()


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


async def test_a_starttls_reception_shows_its_tls_in_the_log_and_in_log_json(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str
) -> None:
    queue_id = await receive_over_starttls(tmp_path, pool, db_url)
    [written] = [json.loads(line) for line in (tmp_path / "delivery.log").read_text().splitlines()]
    [stored] = await pigeon_log_json(db_url, queue_id)
    for record in (written, stored):
        assert record["type"] == "Reception" and record["queue_id"] == str(queue_id)
        assert record["tls"] is not None, record
        assert record["tls"]["version"] in ("TLSv1.2", "TLSv1.3")
        assert record["tls"]["cipher"]
    assert written["tls"] == stored["tls"]


async def test_a_reception_has_one_timestamp_in_the_log_and_in_log_json(
    tmp_path: Path, pool: asyncpg.Pool, db_url: str
) -> None:
    queue_id = await receive_over_starttls(tmp_path, pool, db_url)
    [written] = [json.loads(line) for line in (tmp_path / "delivery.log").read_text().splitlines()]
    [stored] = await pigeon_log_json(db_url, queue_id)
    assert written["timestamp"] == stored["timestamp"]
    assert written == stored
