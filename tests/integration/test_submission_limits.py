"""Sender-domain policy and limits: size, recipients, rate, connections, idle and DATA timeouts.

client ──SMTP (+AUTH over TLS)──► listeners with small limits ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import smtplib
import socket
from pathlib import Path

import asyncpg
import pytest

from tests.integration.submission_helpers import (
    ServerTLS,
    add_user,
    counts,
    make_settings,
    make_tls,
    message,
    message_rows,
    running_service,
    smtp_client,
    wait_until,
)


def authenticated(port: int, tls: ServerTLS) -> smtplib.SMTP:
    client = smtplib.SMTP_SSL("127.0.0.1", port, context=tls.client_context(), timeout=30)
    client.login("alice", "correct horse battery staple")
    return client


@pytest.mark.parametrize("policy", ["strict", "envelope", "off"])
async def test_sender_domain_policy(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, policy: str
) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    await add_user(pool, "mallory", org="other", domains=("other.example",))
    settings = make_settings(tmp_path, db_url, tls, modes=("submissions",), sender_policy=policy)
    async with running_service(settings, pool) as running:

        def attempt(envelope_from: str, header_from: str) -> int:
            with authenticated(running.port("submissions"), tls) as client:
                code, _ = client.mail(envelope_from)
                if code != 250:
                    return code
                client.rcpt("bob@example.net")
                code, _ = client.data(message(header_from, "bob@example.net"))
                return code

        own = await asyncio.to_thread(attempt, "app@acme.example", "App <app@ACME.example>")
        foreign_envelope = await asyncio.to_thread(attempt, "ceo@other.example", "app@acme.example")
        foreign_header = await asyncio.to_thread(
            attempt, "app@acme.example", "CEO <ceo@other.example>"
        )
        unreadable_header = await asyncio.to_thread(
            attempt, "app@acme.example", "ceo@@other.example"
        )
        null_sender = await asyncio.to_thread(attempt, "<>", "app@acme.example")
    assert own == 250 and null_sender == 250
    if policy == "strict":
        assert (foreign_envelope, foreign_header, unreadable_header) == (553, 553, 550)
    elif policy == "envelope":
        assert (foreign_envelope, foreign_header, unreadable_header) == (553, 250, 250)
    else:
        assert (foreign_envelope, foreign_header, unreadable_header) == (250, 250, 250)


async def test_sender_policy_reply_text(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def attempt() -> tuple[int, bytes]:
            with authenticated(running.port("submissions"), tls) as client:
                return client.mail("someone@gmail.example")

        code, text = await asyncio.to_thread(attempt)
    assert (code, text[:5]) == (553, b"5.7.1")
    assert await counts(pool) == (0, 0)


async def test_size_limit(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), max_message_size=10_000)
    async with running_service(settings, pool) as running:

        def attempt() -> tuple[tuple[int, bytes], tuple[int, bytes], tuple[int, bytes]]:
            with smtp_client(running.port("relay")) as client:
                client.ehlo()
                declared = client.mail("a@host.internal", ["SIZE=20000"])
                client.rset()
                client.mail("a@host.internal")
                client.rcpt("b@example.net")
                too_big = client.data(message("a@x", "b@y", body="x" * 70 + "\r\n") * 200)
                client.mail("a@host.internal")
                client.rcpt("b@example.net")
                fits = client.data(message("a@x", "b@y", body="small\r\n"))
                return declared, too_big, fits

        declared, too_big, fits = await asyncio.to_thread(attempt)
    assert declared == (552, b"5.3.4 Message size exceeds fixed maximum message size")
    assert too_big == declared
    assert fits[0] == 250
    assert await counts(pool) == (1, 1)


def _two_messages(port: int, first: bytes, second: bytes) -> tuple[tuple[int, bytes], ...]:
    """One session from a trusted client: `first` to b@example.net, then `second` to
    c@example.net; the replies to their DATA."""
    with smtp_client(port) as client:
        client.ehlo()
        replies = []
        for recipient, data in (("b@example.net", first), ("c@example.net", second)):
            client.mail("a@host.internal")
            client.rcpt(recipient)
            replies.append(client.data(data))
        return tuple(replies)


async def test_header_size_limit(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    """A header section over limits.max_header_size gets 552 5.3.4 after its DATA and is not
    queued; a message whose body, not header, is that large goes through; the session goes on."""
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), max_header_size=2_000)
    folded = "Subject: long\r\n" + " more words\r\n" * 200  # 2,415 octets of header
    async with running_service(settings, pool) as running:
        big_header, big_body = await asyncio.to_thread(
            _two_messages,
            running.port("relay"),
            f"From: a@x\r\n{folded}\r\nshort body\r\n".encode(),
            message("a@x", "c@y", body=("x" * 70 + "\r\n") * 100),
        )
    assert big_header == (552, b"5.3.4 Message header exceeds fixed maximum header size")
    assert big_body[0] == 250
    assert [r["recipients"] for r in await message_rows(pool)] == [["c@example.net"]]


@pytest.mark.parametrize("long_lines", ["fold", "refuse"])
async def test_lines_over_998_octets(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, long_lines: str
) -> None:
    """An application's HTML on one 5,000-octet line: folded and queued (as Postfix relays it), or
    refused with 500 5.5.2 when limits.long_lines says so; the session goes on either way."""
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), long_lines=long_lines)
    html = "<p>" + "lorem ipsum " * 416 + "</p>"  # 4,999 octets, spaces to fold at
    async with running_service(settings, pool) as running:
        long, short = await asyncio.to_thread(
            _two_messages,
            running.port("relay"),
            message("a@x", "b@y", body=html + "\r\n"),
            message("a@x", "c@y", body="short\r\n"),
        )
    assert short[0] == 250
    rows = await message_rows(pool)
    if long_lines == "refuse":
        assert long == (500, b"5.5.2 Line too long (RFC 5321 4.5.3.1.6)")
        assert [r["recipients"] for r in rows] == [["c@example.net"]]
        return
    assert long[0] == 250
    assert [r["recipients"] for r in rows] == [["b@example.net"], ["c@example.net"]]
    body = bytes(rows[0]["body"])
    assert max(len(line) for line in body.split(b"\r\n")) <= 998
    text = body.split(b"\r\n\r\n", 1)[1]
    assert text.replace(b"\r\n", b"") == html.encode()  # broken before spaces only


async def test_recipient_limit(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), max_recipients=3)
    async with running_service(settings, pool) as running:

        def attempt() -> dict[str, tuple[int, bytes]]:
            with smtp_client(running.port("relay")) as client:
                return client.sendmail(
                    "a@host.internal",
                    [f"r{i}@example.net" for i in range(5)],
                    message("a@host.internal", "r0@example.net"),
                )

        refused = await asyncio.to_thread(attempt)
    assert refused == {
        "r3@example.net": (452, b"4.5.3 Too many recipients"),
        "r4@example.net": (452, b"4.5.3 Too many recipients"),
    }
    [row] = await message_rows(pool)
    assert row["recipients"] == ["r0@example.net", "r1@example.net", "r2@example.net"]


async def test_credential_rate_limit(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    settings = make_settings(tmp_path, db_url, tls, modes=("submissions",), credential_rate_limit=2)
    async with running_service(settings, pool) as running:

        def attempt() -> list[int]:
            codes = []
            with authenticated(running.port("submissions"), tls) as client:
                for i in range(3):
                    code, _ = client.mail("app@acme.example")
                    if code == 250:
                        client.rcpt("bob@example.net")
                        code, _ = client.data(message("app@acme.example", "bob", f"n{i}"))
                    codes.append(code)
                    if code != 250:
                        client.rset()
            return codes

        assert await asyncio.to_thread(attempt) == [250, 250, 450]
    assert await counts(pool) == (2, 2)  # nothing accepted was dropped


async def test_idle_client_is_disconnected(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), command_timeout=0.5)
    async with running_service(settings, pool) as running:

        def idle() -> bytes:
            with socket.create_connection(("127.0.0.1", running.port("relay"))) as s:
                s.settimeout(30)
                s.sendall(b"EHLO client.test\r\n")
                received = b""
                while chunk := s.recv(4096):  # the server hangs up: recv returns b""
                    received += chunk
                return received

        transcript = await asyncio.to_thread(idle)
    assert transcript.startswith(b"220 ")
    assert transcript.endswith(b"421 4.4.2 mta.test Error: timeout exceeded\r\n")


async def test_slow_data_is_cut_off_and_nothing_is_queued(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), data_timeout=0.5)
    async with running_service(settings, pool) as running:

        def slow() -> bytes:
            with socket.create_connection(("127.0.0.1", running.port("relay"))) as s:
                s.settimeout(30)
                s.sendall(b"EHLO c\r\nMAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n")
                s.sendall(b"Subject: never finished\r\n\r\nstill typing")
                received = b""
                while chunk := s.recv(4096):
                    received += chunk
                return received

        transcript = await asyncio.to_thread(slow)
    assert b"354 " in transcript and transcript.endswith(
        b"421 4.4.2 mta.test Error: timeout exceeded\r\n"
    )
    assert await counts(pool) == (0, 0)


async def test_connections_per_client_ip(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    settings = make_settings(tmp_path, db_url, make_tls(tmp_path), max_connections_per_ip=2)
    async with running_service(settings, pool) as running:
        port = running.port("relay")

        def greeting(source: str) -> tuple[socket.socket, bytes]:
            s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
            s.settimeout(30)
            return s, s.recv(4096)

        first, g1 = await asyncio.to_thread(greeting, "127.0.0.1")
        second, g2 = await asyncio.to_thread(greeting, "127.0.0.1")
        third, g3 = await asyncio.to_thread(greeting, "127.0.0.1")
        other, g4 = await asyncio.to_thread(greeting, "127.0.0.4")
        for s in (first, second, third, other):
            s.close()
        # Once one closes, the client may connect again.
        await wait_until(lambda: running.service.connections.open_from("127.0.0.1") < 2)
        again, g5 = await asyncio.to_thread(greeting, "127.0.0.1")
        again.close()
    assert g1.startswith(b"220 ") and g2.startswith(b"220 ") and g4.startswith(b"220 ")
    assert g3 == b"421 4.7.0 mta.test Too many connections from your address\r\n"
    assert g5.startswith(b"220 ")
