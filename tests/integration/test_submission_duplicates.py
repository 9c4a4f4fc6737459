"""Duplicate submissions (limits.duplicate_window): a retried message is queued once per recipient.

smtplib clients (127.0.0.1, trusted) ──SMTP──► relay listener ──► PostgreSQL ◄── `pigeon-mta log`
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import smtplib
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
from prometheus_client import REGISTRY

from pigeon_mta.config import Duration, Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.intake.accept import Intake
from pigeon_mta.submission.service import SubmissionService
from tests.conftest import run_pigeon
from tests.integration.submission_helpers import (
    Running,
    make_settings,
    message_rows,
    queue_id_of,
    running_service,
    smtp_client,
)

SENDER = "app@acme.example"


def message(message_id: str | None, subject: str = "Your invoice") -> bytes:
    header = f"Message-ID: <{message_id}>\r\n" if message_id else ""
    return (
        f"From: {SENDER}\r\nTo: customers@example.net\r\n{header}Subject: {subject}\r\n\r\n"
        "Hello.\r\n"
    ).encode()


def relay_settings(tmp_path: Path, db_url: str, **limits: object) -> Settings:
    return make_settings(tmp_path, db_url, None, modes=("relay",), **limits)


def submit(port: int, recipients: list[str], data: bytes) -> uuid.UUID:
    """One transaction on a connection of its own; the queue id of its 250."""
    with smtp_client(port) as client:
        return send(client, recipients, data)


def send(client: smtplib.SMTP, recipients: list[str], data: bytes) -> uuid.UUID:
    client.ehlo_or_helo_if_needed()
    code, _ = client.mail(SENDER)
    assert code == 250
    for recipient in recipients:
        code, _ = client.rcpt(recipient)
        assert code == 250
    code, reply = client.data(data)
    assert code == 250, reply
    assert reply.startswith(b"2.0.0 Ok: queued as "), reply
    return queue_id_of(reply)


async def queued(pool: asyncpg.Pool) -> dict[uuid.UUID, list[str]]:
    """Every queued message with its recipients, by queue id."""
    return {row["id"]: list(row["recipients"]) for row in await message_rows(pool)}


def duplicates_counted(listener: str = "relay") -> float:
    value = REGISTRY.get_sample_value("pigeon_duplicate_recipients_total", {"listener": listener})
    return value or 0.0


async def test_the_same_message_sent_twice_is_queued_once_and_both_replies_name_it(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    data = message("invoice-1@acme.example")
    counted = duplicates_counted()
    async with running_service(relay_settings(tmp_path, db_url), pool) as running:

        def twice() -> tuple[uuid.UUID, uuid.UUID]:
            with smtp_client(running.port("relay")) as client:
                first = send(client, ["bob@example.net", "carol@example.org"], data)
                # The retry spells one address in other cases: the same mailbox, as the
                # suppression list compares them.
                second = send(client, ["carol@example.org", "Bob@Example.NET"], data)
                return first, second

        first, second = await asyncio.to_thread(twice)

    assert second == first
    assert await queued(pool) == {first: ["bob@example.net", "carol@example.org"]}
    assert duplicates_counted() - counted == 2


async def test_new_recipients_of_a_known_message_id_are_queued_for_them_alone(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """A client that splits one message's recipients over several transactions (Postfix above
    its recipient limit) reaches everyone: the check is per recipient."""
    data = message("newsletter-7@acme.example")
    async with running_service(relay_settings(tmp_path, db_url), pool) as running:
        port = running.port("relay")
        first = await asyncio.to_thread(submit, port, ["a@example.net", "b@example.net"], data)
        second = await asyncio.to_thread(
            submit, port, ["a@example.net", "b@example.net", "c@example.org"], data
        )
        third = await asyncio.to_thread(submit, port, ["d@example.org"], data)

    assert len({first, second, third}) == 3
    assert await queued(pool) == {
        first: ["a@example.net", "b@example.net"],
        second: ["c@example.org"],
        third: ["d@example.org"],
    }


async def test_with_the_window_off_both_are_queued(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    data = message("invoice-2@acme.example")
    settings = relay_settings(tmp_path, db_url, duplicate_window=Duration.parse("0"))
    async with running_service(settings, pool) as running:
        port = running.port("relay")
        first = await asyncio.to_thread(submit, port, ["bob@example.net"], data)
        second = await asyncio.to_thread(submit, port, ["bob@example.net"], data)

    assert first != second
    assert await queued(pool) == {first: ["bob@example.net"], second: ["bob@example.net"]}


async def test_outside_the_window_the_same_message_is_queued_again(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    data = message("reminder-3@acme.example")
    settings = relay_settings(tmp_path, db_url, duplicate_window=Duration.parse("1s"))
    async with running_service(settings, pool) as running:
        port = running.port("relay")
        first = await asyncio.to_thread(submit, port, ["bob@example.net"], data)
        within = await asyncio.to_thread(submit, port, ["bob@example.net"], data)
        await asyncio.sleep(1.5)  # past the 1 s window of the first (not a timing assertion)
        after = await asyncio.to_thread(submit, port, ["bob@example.net"], data)
        again = await asyncio.to_thread(submit, port, ["bob@example.net"], data)

    assert within == first
    assert after != first
    assert again == after  # the new message starts a window of its own
    assert await queued(pool) == {first: ["bob@example.net"], after: ["bob@example.net"]}


async def test_a_message_without_its_own_message_id_is_never_a_duplicate(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """pigeon adds a Message-ID to a message without one; that one says nothing about a retry."""
    data = message(None)
    async with running_service(relay_settings(tmp_path, db_url), pool) as running:
        port = running.port("relay")
        first = await asyncio.to_thread(submit, port, ["bob@example.net"], data)
        second = await asyncio.to_thread(submit, port, ["bob@example.net"], data)

    assert first != second
    assert await queued(pool) == {first: ["bob@example.net"], second: ["bob@example.net"]}


async def test_another_org_with_the_same_message_id_is_queued(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """Message-IDs are compared within an org: one org's cannot hold back another org's mail."""
    data = message("shared-1@example.com")
    settings = relay_settings(tmp_path, db_url)
    other = dataclasses.replace(
        settings, relay=dataclasses.replace(settings.relay, trusted_org="b")
    )
    queue_ids = []
    for each in (settings, other):
        async with running_service(each, pool) as running:
            port = running.port("relay")
            queue_ids.append(await asyncio.to_thread(submit, port, ["bob@example.net"], data))

    rows = await pool.fetch("SELECT id, org_id FROM message")
    assert {r["id"] for r in rows} == set(queue_ids)
    assert len({r["org_id"] for r in rows}) == 2


async def test_two_identical_submissions_in_parallel_queue_it_once(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """Two connections ready to send the same message, released together: each round, one
    message is queued and both clients are answered with its queue id."""
    rounds = 6
    async with running_service(relay_settings(tmp_path, db_url), pool) as running:
        port = running.port("relay")

        def in_parallel(message_id: str) -> list[uuid.UUID]:
            ready = threading.Barrier(2, timeout=30)
            replies: list[uuid.UUID] = []

            def client() -> None:
                with smtp_client(port) as smtp:
                    smtp.ehlo()
                    assert smtp.mail(SENDER)[0] == 250
                    assert smtp.rcpt("bob@example.net")[0] == 250
                    assert smtp.rcpt("carol@example.org")[0] == 250
                    ready.wait()
                    code, reply = smtp.data(message(message_id))
                    assert code == 250, reply
                    replies.append(queue_id_of(reply))

            threads = [threading.Thread(target=client) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            return replies

        outcomes = [
            await asyncio.to_thread(in_parallel, f"parallel-{n}@acme.example")
            for n in range(rounds)
        ]

    rows = await queued(pool)
    assert len(rows) == rounds
    for replies in outcomes:
        assert len(replies) == 2 and replies[0] == replies[1]
        assert rows[replies[0]] == ["bob@example.net", "carol@example.org"]


@contextlib.asynccontextmanager
async def service_with_delivery_log(
    settings: Settings, pool: asyncpg.Pool, path: Path
) -> AsyncIterator[Running]:
    delivery_log = DeliveryLog.open(str(path))
    service = SubmissionService(
        settings, pool, Intake.of(settings, pool, delivery_log=delivery_log)
    )
    await service.start()
    try:
        yield Running(service, pool, settings)
    finally:
        await service.stop(asyncio.get_running_loop().time() + 5)
        delivery_log.close()


async def test_log_shows_the_duplicate_reception(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    data = message("order-42@acme.example")
    delivery_log = tmp_path / "delivery.log"
    settings = relay_settings(tmp_path, db_url)
    async with service_with_delivery_log(settings, pool, delivery_log) as running:
        port = running.port("relay")
        first = await asyncio.to_thread(submit, port, ["bob@example.net"], data)
        second = await asyncio.to_thread(
            submit, port, ["bob@example.net", "carol@example.org"], data
        )
    assert second != first  # carol is new: queued in a message of her own

    env = {"PIGEON_DATABASE_URL": db_url, "PIGEON_CONFIG": ""}
    result = await asyncio.to_thread(run_pigeon, "log", "<order-42@acme.example>", env=env)
    assert result.returncode == 0, result.stderr
    timeline = [line for line in result.stdout.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert [line.split()[2] for line in timeline] == ["Reception", "Duplicate", "Reception"]
    duplicate = timeline[1]
    assert "bob@example.net" in duplicate and "127.0.0.1" in duplicate
    assert f"250 2.0.0 Ok: queued as {second}" in duplicate
    assert "not queued again" in duplicate

    result = await asyncio.to_thread(run_pigeon, "log", "order-42@acme.example", "--json", env=env)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    duplicates = [r for r in records if r["type"] == "Duplicate"]
    assert len(duplicates) == 1
    assert duplicates[0]["queue_id"] == str(first)
    assert duplicates[0]["recipient"] == "bob@example.net"
    assert duplicates[0]["message_id"] == "order-42@acme.example"
    assert duplicates[0]["response"] == f"Ok: queued as {second}"
    # The delivery log wrote the same record when the duplicate arrived.
    written = [json.loads(line) for line in delivery_log.read_text().splitlines()]
    assert [r["type"] for r in written] == ["Reception", "Duplicate", "Reception"]
    assert written[1] == duplicates[0]


async def test_a_reused_message_id_with_other_content_is_queued_and_the_log_says_so(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """An application that gives every message of a template one Message-ID: the second
    message, with another body, is not taken for a duplicate of the first. A retry, with a Date
    its software wrote again, still is one."""
    first_data = message("template@acme.example") + b"Your code is 1111.\r\n"
    retry_data = b"Date: Wed, 02 Dec 2026 10:00:00 +0000\r\n" + first_data
    other_data = message("template@acme.example") + b"Your code is 2222.\r\n"
    counted = duplicates_counted()
    async with running_service(relay_settings(tmp_path, db_url), pool) as running:
        port = running.port("relay")
        first = await asyncio.to_thread(submit, port, ["bob@example.net"], first_data)
        retry = await asyncio.to_thread(submit, port, ["bob@example.net"], retry_data)
        other = await asyncio.to_thread(submit, port, ["bob@example.net"], other_data)
        other_retry = await asyncio.to_thread(submit, port, ["bob@example.net"], other_data)

    assert retry == first  # the same body, a Date written again: a duplicate
    assert other != first
    assert other_retry == other  # the new content's own retry is a duplicate of it
    assert await queued(pool) == {first: ["bob@example.net"], other: ["bob@example.net"]}
    assert duplicates_counted() - counted == 2
    story = run_pigeon("log", str(other), env={"PIGEON_DATABASE_URL": db_url})
    assert story.returncode == 0, story.stderr
    assert f"no: message {first} has the same Message-ID and other content" in story.stdout
    plain = run_pigeon("log", str(first), env={"PIGEON_DATABASE_URL": db_url})
    assert "duplicate?" not in plain.stdout
