"""Open-relay suite: an untrusted client that did not AUTH gets no mail through, whatever the trick.

untrusted client (bound to 127.0.0.2) ──SMTP──► relay listener (trusted_networks = 127.0.0.1/32)
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import asyncpg
import pytest

from tests.integration.submission_helpers import (
    HOSTNAME,
    UNTRUSTED_CLIENT,
    counts,
    make_settings,
    make_tls,
    running_service,
    smtp_client,
)

# The classic tricks (see e.g. the relay tests of abuse.net and RFC 2505 2.4/2.5); each is tried as
# RCPT TO, with a few MAIL FROM variants.
RELAY_TRICKS = [
    "<victim@external.example>",
    "<victim%external.example@mta.test>",
    "<victim%external.example@[127.0.0.1]>",
    '<"victim@external.example">',
    '<"victim@external.example"@mta.test>',
    '<"victim%external.example"@mta.test>',
    "<@mta.test:victim@external.example>",
    "<@mta.test,@relay.example:victim@external.example>",
    "<external.example!victim>",
    "<external.example!victim@mta.test>",
    "<victim@[1.2.3.4]>",
    "<victim@[IPv6:::1]>",
    "<victim@[127.0.0.1]>",
    "<VICTIM@EXTERNAL.EXAMPLE>",
    "<victim@external.example.>",
    "< victim@external.example >",
    "victim@external.example",
    "<victim@mta.test@external.example>",
    "<victim\\@external.example@mta.test>",
    "<victim@mta.test>",
    "<victim@localhost>",
    "<postmaster>",
    "<postmaster@mta.test>",
    "<victim@external.example> NOTIFY=NEVER",
    "<victim@ExTeRnAl.ExAmPlE>",
    "<victim@xn--bcher-kva.example>",
]


def converse(port: int, lines: list[str]) -> list[tuple[int, bytes]]:
    replies = []
    with smtp_client(port, source=UNTRUSTED_CLIENT) as client:
        for line in lines:
            replies.append(client.docmd(line))
    return replies


@pytest.fixture
async def relay(tmp_path: Path, db_url: str, pool: asyncpg.Pool):  # type: ignore[no-untyped-def]
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), modes=("relay", "submission"))
    async with running_service(settings, pool) as running:
        yield running


async def test_no_relay_trick_gets_a_recipient_accepted(relay, pool: asyncpg.Pool) -> None:  # type: ignore[no-untyped-def]
    assert len(RELAY_TRICKS) >= 15
    lines = [f"EHLO {HOSTNAME}", "MAIL FROM:<someone@mta.test>"]
    lines += [f"RCPT TO:{trick}" for trick in RELAY_TRICKS]
    lines += ["DATA"]
    replies = await asyncio.to_thread(converse, relay.port("relay"), lines)
    rcpt_replies = replies[2:-1]
    for trick, (code, text) in zip(RELAY_TRICKS, rcpt_replies, strict=True):
        assert code >= 500, f"RCPT TO:{trick} got {code} {text!r}"
    # The usual form of a plain relay attempt gets the usual answer.
    assert rcpt_replies[0] == (554, b"5.7.1 Relay access denied")
    assert replies[-1][0] == 503  # no recipient, no DATA
    assert await counts(pool) == (0, 0)


@pytest.mark.parametrize(
    "sender",
    [
        "<>",
        "<postmaster@mta.test>",
        "<someone@localhost>",
        "<root@[127.0.0.1]>",
        "<victim@external.example>",
    ],
)
async def test_no_sender_makes_the_client_trusted(relay, pool: asyncpg.Pool, sender: str) -> None:  # type: ignore[no-untyped-def]
    lines = [
        "HELO localhost",
        f"MAIL FROM:{sender}",
        "RCPT TO:<victim@external.example>",
        "RSET",
        "EHLO [127.0.0.1]",
        f"MAIL FROM:{sender}",
        "RCPT TO:<victim@external.example>",
    ]
    replies = await asyncio.to_thread(converse, relay.port("relay"), lines)
    assert replies[2][0] >= 500 and replies[6][0] >= 500
    assert await counts(pool) == (0, 0)


async def test_pipelined_relay_attempt_and_failed_auth_do_not_help(
    relay, pool: asyncpg.Pool
) -> None:  # type: ignore[no-untyped-def]
    """The whole transaction in one write (PIPELINING), after a failed AUTH and an XCLIENT try."""
    port = relay.port("relay")

    def pipelined() -> bytes:
        with socket.create_connection(
            ("127.0.0.1", port), source_address=(UNTRUSTED_CLIENT, 0)
        ) as s:
            s.settimeout(30)
            s.sendall(
                b"EHLO mta.test\r\nXCLIENT ADDR=127.0.0.1\r\nAUTH PLAIN AGFkbWluAGFkbWlu\r\n"
                b"MAIL FROM:<a@mta.test>\r\nRCPT TO:<victim@external.example>\r\n"
                b"RCPT TO:<victim%external.example@mta.test>\r\nDATA\r\n"
                b"Subject: spam\r\n\r\nspam\r\n.\r\nQUIT\r\n"
            )
            received = b""
            while chunk := s.recv(65536):
                received += chunk
            return received

    transcript = await asyncio.to_thread(pipelined)
    assert b"\r\n250 2.0.0 Ok: queued" not in transcript
    assert transcript.count(b"554 5.7.1 Relay access denied") == 2
    assert await counts(pool) == (0, 0)


async def test_submission_listener_never_relays_for_unauthenticated_clients(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """Trusted networks are a relay-listener feature: on submission even 127.0.0.1 must AUTH."""
    settings = make_settings(
        tmp_path, db_url, make_tls(tmp_path), modes=("submission",), plaintext_auth=True
    )
    async with running_service(settings, pool) as running:
        replies = await asyncio.to_thread(
            converse,
            running.port("submission"),
            ["EHLO x", "MAIL FROM:<a@mta.test>", "RCPT TO:<victim@external.example>"],
        )
    assert replies[1][0] == 530 and replies[2][0] >= 500
    assert await counts(pool) == (0, 0)
