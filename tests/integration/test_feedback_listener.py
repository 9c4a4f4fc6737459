"""The feedback listener over real SMTP: it takes mail only for the return-path domains and the
complaint addresses, never relays (the open-relay suite's tricks, trusted client or not), keeps
what it takes before its 250 once per report, and hostile mail is kept and read without harm.

smtplib client ──SMTP──► feedback listener (SubmissionService, mode "feedback") ── PostgreSQL
                                   └─ FeedbackProcessor (woken per kept message)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.config import BounceSettings, Settings
from pigeon_mta.feedback.processor import FeedbackProcessor
from pigeon_mta.feedback.return_paths import ReturnPaths
from pigeon_mta.submission.service import Feedback, SubmissionService
from tests.integration.submission_helpers import (
    HOSTNAME,
    TRUSTED_CLIENT,
    UNTRUSTED_CLIENT,
    make_settings,
    make_tls,
    smtp_client,
)
from tests.integration.test_api_database_outage import set_reachable
from tests.integration.test_submission_relay import RELAY_TRICKS
from tests.peers import feedback_reports as reports

RETURN_PATH = "bounces.mta.test"
VERP = "b-" + "a" * 40 + "@" + RETURN_PATH


@dataclasses.dataclass
class Listening:
    port: int
    processor: FeedbackProcessor


@contextlib.asynccontextmanager
async def feedback_listener(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[Listening]:
    paths = ReturnPaths(settings, pool)
    await paths.refresh()
    processor = FeedbackProcessor(pool, paths, poll=0.2)
    await processor.start()
    service = SubmissionService(settings, pool, feedback=Feedback(paths, processor.poke))
    await service.start()
    try:
        yield Listening(service.bound["feedback"][1], processor)
    finally:
        await service.stop(asyncio.get_running_loop().time() + 5)
        await processor.stop(asyncio.get_running_loop().time() + 5)


@pytest.fixture
async def listening(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> AsyncIterator[Listening]:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("feedback",))
    settings = dataclasses.replace(
        settings,
        bounces=BounceSettings(
            return_path_domain=RETURN_PATH, complaint_addresses=("fbl@mta.test",)
        ),
    )
    async with feedback_listener(settings, pool) as running:
        yield running


def converse(port: int, lines: list[str], source: str) -> list[tuple[int, bytes]]:
    with smtp_client(port, source=source) as client:
        return [client.docmd(line) for line in lines]


def deliver(port: int, rcpt: str, body: bytes, sender: str = "") -> tuple[int, bytes]:
    with smtp_client(port, source=UNTRUSTED_CLIENT) as client:
        client.ehlo(HOSTNAME)
        client.mail(sender)
        code, text = client.rcpt(rcpt)
        assert code == 250, (code, text)
        return client.data(body)


async def kept(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT status, rcpt_to, length(body) AS size FROM feedback")


@pytest.mark.parametrize("source", [UNTRUSTED_CLIENT, TRUSTED_CLIENT])
async def test_no_relay_trick_gets_a_recipient_accepted(
    listening: Listening, pool: asyncpg.Pool, source: str
) -> None:
    lines = [f"EHLO {HOSTNAME}", "MAIL FROM:<>"]
    lines += [f"RCPT TO:{trick}" for trick in RELAY_TRICKS]
    lines += ["DATA"]
    replies = await asyncio.to_thread(converse, listening.port, lines, source)
    for trick, (code, text) in zip(RELAY_TRICKS, replies[2:-1], strict=True):
        assert code >= 500, f"RCPT TO:{trick} got {code} {text!r}"
    assert replies[2][0] == 550 and b"5.7.1" in replies[2][1]
    assert replies[-1][0] == 503
    assert await kept(pool) == []
    assert await pool.fetchval("SELECT count(*) FROM message") == 0


async def test_no_auth_is_offered_and_addresses_elsewhere_are_refused(
    listening: Listening, pool: asyncpg.Pool
) -> None:
    replies = await asyncio.to_thread(
        converse,
        listening.port,
        [
            f"EHLO {HOSTNAME}",
            "AUTH PLAIN AGFsaWNlAHBhc3N3b3Jk",
            "MAIL FROM:<>",
            f"RCPT TO:<someone@{RETURN_PATH}.evil.example>",
            "RCPT TO:<fbl@mta.test.evil.example>",
            "RCPT TO:<other@mta.test>",
            f"RCPT TO:<{VERP}>",
            "RCPT TO:<FBL@MTA.TEST>",
        ],
        UNTRUSTED_CLIENT,
    )
    assert b"AUTH" not in replies[0][1]
    assert replies[1][0] >= 500
    assert [code for code, _text in replies[3:6]] == [550, 550, 550]
    assert [code for code, _text in replies[6:]] == [250, 250]


async def test_a_report_is_kept_before_the_250_and_once_however_often_it_comes(
    listening: Listening, pool: asyncpg.Pool
) -> None:
    body = reports.dsn(to=VERP, recipient="ann@dest.example")
    answers = [await asyncio.to_thread(deliver, listening.port, VERP, body) for _ in range(3)]
    assert len({a for a in answers}) == 1 and answers[0][0] == 250
    assert answers[0][1].startswith(b"2.0.0 Ok: kept as ")
    rows = await kept(pool)
    assert len(rows) == 1 and list(rows[0]["rcpt_to"]) == [VERP]
    # Read by the processor the listener woke: the token is no key's, so nobody matches.
    for _ in range(250):  # bounded: 5 s
        if (await kept(pool))[0]["status"] != "new":
            break
        await asyncio.sleep(0.02)
    assert (await kept(pool))[0]["status"] == "unmatched"


@pytest.mark.parametrize(
    "body",
    [
        reports.nested_multipart(5000, 1_000_000),
        reports.nested_multipart(40, 1_000_000),
        reports.human_reply(to=VERP),
        b"\x00\xff\xfe binary junk \r\n" * 2000,
    ],
    ids=["5000-nested", "40-nested", "reply", "binary"],
)
async def test_hostile_or_odd_mail_is_kept_and_not_understood(
    listening: Listening, pool: asyncpg.Pool, body: bytes
) -> None:
    code, _text = await asyncio.to_thread(deliver, listening.port, VERP, body)
    assert code == 250
    for _ in range(500):  # bounded: 10 s
        rows = await kept(pool)
        if rows and rows[0]["status"] != "new":
            break
        await asyncio.sleep(0.02)
    [row] = await kept(pool)
    assert row["status"] == "not-understood"
    # And the listener still answers.
    replies = await asyncio.to_thread(converse, listening.port, ["NOOP"], UNTRUSTED_CLIENT)
    assert replies[0][0] == 250


async def test_a_database_away_gets_451_and_nothing_is_lost(
    listening: Listening, pool: asyncpg.Pool, admin_url: str, db_url: str
) -> None:
    """The report cannot be kept: the sender is told to try again (451), never 250; once the
    database is back, its retry is kept and read."""
    body = reports.dsn(to=VERP, recipient="ann@dest.example")
    await set_reachable(admin_url, db_url, False)
    try:
        code, text = await asyncio.to_thread(deliver, listening.port, VERP, body)
    finally:
        await set_reachable(admin_url, db_url, True)
    assert (code, text) == (451, b"4.3.0 Temporary failure keeping the message, try again later")
    assert await kept(pool) == []
    code, _text = await asyncio.to_thread(deliver, listening.port, VERP, body)
    assert code == 250
    assert len(await kept(pool)) == 1
