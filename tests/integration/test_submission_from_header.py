"""The originator fields at reception: From: within bounds from every client, and what the strict
sender policy asks of From:, Sender:, Resent-From: and Resent-Sender:.

client ──SMTP (trusted relay, or AUTH over TLS)──► listeners ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import logging
import smtplib
from pathlib import Path

import asyncpg
import pytest
from prometheus_client import REGISTRY

from tests.integration.submission_helpers import (
    ServerTLS,
    add_user,
    counts,
    make_settings,
    make_tls,
    message_rows,
    running_service,
    smtp_client,
)

# Deep enough for the standard library parsers to raise RecursionError; under max_from_length.
NESTED_COMMENTS = "(" * 3_000 + ")" * 3_000 + " app@acme.example"


def _data(header: str, body: str = "Hello.\r\n") -> bytes:
    return f"{header}To: bob@example.net\r\nSubject: test\r\n\r\n{body}".encode()


def _relay(port: int, data: list[bytes]) -> list[tuple[int, bytes]]:
    """One session from a trusted client; the reply to each message's DATA."""
    with smtp_client(port) as client:
        client.ehlo()
        replies = []
        for message in data:
            client.mail("app@host.internal")
            client.rcpt("bob@example.net")
            replies.append(client.data(message))
        return replies


def _submit(port: int, tls: ServerTLS, data: list[bytes]) -> list[tuple[int, bytes]]:
    """One session of an AUTH user of acme.example; the reply to each message's DATA."""
    with smtplib.SMTP_SSL("127.0.0.1", port, context=tls.client_context(), timeout=60) as client:
        client.login("alice", "correct horse battery staple")
        replies = []
        for message in data:
            client.mail("app@acme.example")
            client.rcpt("bob@example.net")
            replies.append(client.data(message))
        return replies


def _rejections(reason: str) -> float:
    labels = {"listener": "submissions", "reason": reason}
    return REGISTRY.get_sample_value("pigeon_smtp_rejections_total", labels) or 0.0


async def test_a_from_header_beyond_the_bounds_is_refused_from_a_trusted_client(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """A trusted relay client's From: is not checked against any domain, but it is measured:
    one the DKIM signer could not parse is refused, not queued; the session goes on."""
    huge = ", ".join(f"u{i}@acme.example" for i in range(40_000))  # 700 KB, under max_header_size
    many = ", ".join(f"u{i}@acme.example" for i in range(101))  # limits.max_from_addresses + 1
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path))
    with caplog.at_level(logging.INFO, logger="pigeon_mta"):
        async with running_service(settings, pool) as running:
            replies = await asyncio.to_thread(
                _relay,
                running.port("relay"),
                [
                    _data(f"From: {huge}\r\n"),
                    _data(f"From: {many}\r\n"),
                    _data(f"From: {NESTED_COMMENTS}\r\n"),
                    _data("From: App <app@host.internal>\r\n", body="fine\r\n"),
                ],
            )
    assert replies[:3] == [
        (550, b"5.6.0 From: header is too long"),  # over limits.max_from_length
        (550, b"5.6.0 From: header has too many addresses"),
        (550, b"5.6.0 From: header cannot be parsed"),
    ]
    assert replies[3][0] == 250
    assert await counts(pool) == (1, 1)
    assert not [r for r in caplog.records if r.exc_info], "no traceback is logged"


async def test_the_strict_policy_parses_from_within_the_bounds(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """limits.max_from_addresses addresses of the user's own domain pass, one more does not;
    nested comments get 550 5.6.0 instead of a 451 the client would retry for ever."""
    tls = make_tls(tmp_path)
    await add_user(pool)
    settings = make_settings(tmp_path, db_url, tls, modes=("submissions",))
    own = [f"User {i} <u{i}@acme.example>" for i in range(101)]
    before = _rejections("bad_header")
    with caplog.at_level(logging.INFO, logger="pigeon_mta"):
        async with running_service(settings, pool) as running:
            replies = await asyncio.to_thread(
                _submit,
                running.port("submissions"),
                tls,
                [
                    _data(f"From: {', '.join(own[:100])}\r\n"),
                    _data(f"From: {', '.join(own)}\r\n"),
                    _data(f"From: {NESTED_COMMENTS}\r\n"),
                    _data(f"From: {'(a comment) ' * 800}<app@acme.example>\r\n"),
                ],
            )
    assert replies[0][0] == 250
    assert replies[1:] == [
        (550, b"5.6.0 From: header has too many addresses"),
        (550, b"5.6.0 From: header cannot be parsed"),
        (550, b"5.6.0 From: header is too long"),  # over limits.max_from_length
    ]
    assert _rejections("bad_header") == before + 3
    assert len(await message_rows(pool)) == 1
    assert not [r for r in caplog.records if r.exc_info], "no traceback is logged"


async def test_the_strict_policy_wants_a_from_address(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    settings = make_settings(tmp_path, db_url, tls, modes=("submissions", "relay"))
    no_from = [_data(""), _data("From:\r\n"), _data("From:   \r\n")]
    async with running_service(settings, pool) as running:
        submitted = await asyncio.to_thread(_submit, running.port("submissions"), tls, no_from)
        # Trusted clients are not subject to the sender policy.
        relayed = await asyncio.to_thread(_relay, running.port("relay"), no_from[:1])
    no_address = (550, b"5.7.1 Message has no From: header address (RFC 5322 3.6.2)")
    assert submitted == [no_address] * 3
    assert relayed[0][0] == 250
    assert await counts(pool) == (1, 1)


async def test_the_envelope_policy_does_not_look_for_a_from_address(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    settings = make_settings(
        tmp_path, db_url, tls, modes=("submissions",), sender_policy="envelope"
    )
    async with running_service(settings, pool) as running:
        replies = await asyncio.to_thread(_submit, running.port("submissions"), tls, [_data("")])
    assert replies[0][0] == 250


@pytest.mark.parametrize("field", ["Sender", "Resent-From", "Resent-Sender"])
async def test_the_strict_policy_checks_sender_and_resent_fields_like_from(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, field: str
) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    from_ = "From: App <app@acme.example>\r\n"
    settings = make_settings(tmp_path, db_url, tls, modes=("submissions",))
    async with running_service(settings, pool) as running:
        replies = await asyncio.to_thread(
            _submit,
            running.port("submissions"),
            tls,
            [
                _data(f"{from_}{field}: Ops <ops@ACME.example>\r\n"),
                _data(f"{from_}{field}: CEO <ceo@other.example>\r\n"),
                _data(f"{from_}{field}: ceo@@other.example\r\n"),
            ],
        )
    assert replies[0][0] == 250
    assert replies[1:] == [
        (
            553,
            f"5.7.1 {field}: header address rejected: not owned by the authenticated user".encode(),
        ),
        (550, f"5.6.0 {field}: header cannot be parsed".encode()),
    ]
    assert await counts(pool) == (1, 1)
