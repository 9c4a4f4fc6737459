"""Clients that misbehave on purpose: forged Authentication-Results, routing loops, junk commands.

client (127.0.0.1, trusted) ──SMTP──► relay listener ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import smtplib
import socket
from pathlib import Path

import asyncpg

from tests.integration.submission_helpers import (
    HOSTNAME,
    make_settings,
    message_rows,
    running_service,
    smtp_client,
)


async def test_forged_results_hidden_behind_comments_are_removed(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """RFC 8601 2.2 allows CFWS around the authserv-id: a comment before or after our host name
    does not make a forged field someone else's."""
    forged = (
        f"Authentication-Results: (c) {HOSTNAME}; dkim=pass header.d=bank.example\r\n"
        f"Authentication-Results: {HOSTNAME}(c); spf=pass smtp.mailfrom=bank.example\r\n"
        f"Authentication-Results: (a (b) c) {HOSTNAME.upper()} (d); dmarc=pass\r\n"
        "Authentication-Results: other.example (c); spf=pass\r\n"
    )
    async with running_service(
        make_settings(tmp_path, db_url, None, modes=("relay",)), pool
    ) as running:

        def send() -> int:
            with smtp_client(running.port("relay")) as client:
                client.ehlo()
                client.mail("app@host.internal")
                client.rcpt("bob@example.net")
                code, _ = client.data(f"{forged}Subject: hi\r\n\r\nbody\r\n".encode())
                return code

        assert await asyncio.to_thread(send) == 250
    [row] = await message_rows(pool)
    header = bytes(row["body"]).split(b"\r\n\r\n", 1)[0]
    assert b"dkim=pass" not in header
    assert b"spf=pass smtp.mailfrom=bank.example" not in header
    assert b"dmarc=pass" not in header
    assert b"Authentication-Results: other.example (c); spf=pass\r\n" in header
    assert header.count(b"Authentication-Results:") == 2  # ours and other.example's


def _send_with_received(port: int, hops: int, body_lines: int = 0) -> tuple[int, bytes]:
    trace = "".join(
        f"Received: from hop{n}.example by hop{n + 1}.example; Mon, 1 Jan 2024 00:00:00 +0000\r\n"
        for n in range(hops)
    )
    quoted = "Received: from quoted.example\r\n" * body_lines  # in the body: not a hop
    with smtp_client(port) as client:
        client.ehlo()
        client.mail("app@host.internal")
        client.rcpt("bob@example.net")
        return client.data(f"{trace}Subject: loop?\r\n\r\n{quoted}body\r\n".encode())


async def test_a_message_over_the_hop_limit_is_refused(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """limits.max_hops (50) Received fields at most, ours included, as Postfix's hopcount_limit:
    a routing loop ends at the 50th hop instead of circulating until delivery.max_age."""
    async with running_service(
        make_settings(tmp_path, db_url, None, modes=("relay",)), pool
    ) as running:
        port = running.port("relay")
        looping = await asyncio.to_thread(_send_with_received, port, 50)
        last_hop = await asyncio.to_thread(_send_with_received, port, 49)
        quoting = await asyncio.to_thread(_send_with_received, port, 1, 200)
    assert looping == (554, b"5.4.6 Too many hops")
    assert last_hop[0] == 250 and quoting[0] == 250
    last_body, quoting_body = [bytes(r["body"]) for r in await message_rows(pool)]
    assert last_body.split(b"\r\n\r\n", 1)[0].count(b"Received:") == 50
    assert quoting_body.count(b"Received: from quoted.example") == 200


def _junk_session(port: int, commands: list[str]) -> list[tuple[int, bytes]]:
    """Send each command and collect the replies, up to the one after which the server hung up."""
    replies = []
    with smtp_client(port) as client:
        client.ehlo()
        for command in commands:
            try:
                replies.append(client.docmd(command))
            except smtplib.SMTPServerDisconnected:
                replies.append((-1, b"disconnected"))
                break
    return replies


async def test_a_connection_that_only_sends_noops_is_closed_at_the_limit(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """limits.max_junk_commands (100), as Postfix's smtpd_junk_command_limit: a NOOP every few
    seconds no longer keeps a connection open for ever. The EHLO counts as one."""
    async with running_service(
        make_settings(tmp_path, db_url, None, modes=("relay",)), pool
    ) as running:
        replies = await asyncio.to_thread(_junk_session, running.port("relay"), ["NOOP"] * 105)
    assert replies[:99] == [(250, b"2.0.0 Ok")] * 99
    assert replies[99] == (421, f"4.7.0 {HOSTNAME} Too many junk commands".encode())
    assert replies[100:] == [(-1, b"disconnected")]


async def test_junk_commands_and_errors_count_together_and_a_queued_message_resets_them(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """NOOP, RSET, VRFY, EXPN, HELP, HELO/EHLO and commands refused for their syntax, sequence or
    login count; a message queued starts the count over."""
    settings = make_settings(tmp_path, db_url, None, modes=("relay",), max_junk_commands=10)
    junk = [
        "RSET",
        "VRFY bob@example.net",
        "EXPN staff",
        "HELP",
        "EHLO again.example",
        "DATA",  # 503: no recipients
        "MAIL",  # 501: no FROM:
        "XYZZY",  # 500: unknown
    ]
    async with running_service(settings, pool) as running:
        port = running.port("relay")

        def session() -> tuple[list[int], int, list[int]]:
            with smtp_client(port) as client:
                client.ehlo()  # 1
                codes = [client.docmd(c)[0] for c in ["NOOP", *junk]]  # 2..10
                client.mail("app@host.internal")
                client.rcpt("bob@example.net")
                queued = client.data(b"Subject: s\r\n\r\nbody\r\n")[0]
                # The count starts over: ten more are allowed, the eleventh is not.
                after = [client.docmd(c)[0] for c in ["NOOP", *junk, "NOOP", "NOOP"]]
                return codes, queued, after

        codes, queued, after = await asyncio.to_thread(session)
    assert codes == [250, 250, 252, 502, 250, 250, 503, 501, 500]
    assert queued == 250
    assert after == [250, 250, 252, 502, 250, 250, 503, 501, 500, 250, 421]
    assert len(await message_rows(pool)) == 1


async def test_max_junk_commands_zero_means_no_limit(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    settings = make_settings(tmp_path, db_url, None, modes=("relay",), max_junk_commands=0)
    async with running_service(settings, pool) as running:
        replies = await asyncio.to_thread(_junk_session, running.port("relay"), ["NOOP"] * 300)
    assert {code for code, _text in replies} == {250}


async def test_commands_pipelined_after_the_junk_limit_get_no_reply_and_queue_nothing(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """A client that pipelines a message behind its junk gets the 421 and nothing after it."""
    async with running_service(
        make_settings(tmp_path, db_url, None, modes=("relay",), max_junk_commands=10), pool
    ) as running:
        burst = (
            b"EHLO client.example\r\n"
            + b"NOOP\r\n" * 10
            + b"MAIL FROM:<app@host.internal>\r\nRCPT TO:<bob@example.net>\r\nDATA\r\n"
            + b"Subject: s\r\n\r\nbody\r\n.\r\nQUIT\r\n"
        )

        def talk() -> list[bytes]:
            with socket.create_connection(("127.0.0.1", running.port("relay")), timeout=30) as sock:
                sock.recv(1024)  # the greeting
                sock.sendall(burst)
                received = b""
                while chunk := sock.recv(65536):
                    received += chunk
            return received.splitlines()

        lines = await asyncio.to_thread(talk)
    assert lines[-1] == f"421 4.7.0 {HOSTNAME} Too many junk commands".encode()
    assert lines.count(b"250 2.0.0 Ok") == 9  # EHLO and nine NOOPs make ten
    assert await message_rows(pool) == []
