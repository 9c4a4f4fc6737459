"""Fuzzing with hypothesis: random command lines and DATA bodies never crash the server, never
leave it unresponsive, and dot-stuffed bodies come through byte for byte.

hypothesis (a thread, raw sockets) ──random bytes──► relay + submission listeners (this loop)
                                   ──then a fresh client──► must get 220 and 250 to NOOP
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.integration.submission_helpers import (
    Running,
    make_settings,
    make_tls,
    running_service,
)

FUZZ_SETTINGS = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

VERBS = [
    b"HELO",
    b"EHLO",
    b"MAIL FROM:",
    b"RCPT TO:",
    b"DATA",
    b"RSET",
    b"NOOP",
    b"VRFY",
    b"EXPN",
    b"HELP",
    b"AUTH PLAIN",
    b"AUTH LOGIN",
    b"AUTH CRAM-MD5",
    b"STARTTLS",
    b"BDAT 10",
    b"mail from:<a@b.example> SIZE=",
    b"MAIL FROM:<a@b.example> BODY=8BITMIME SMTPUTF8",
    b"RCPT TO:<x@y.example> NOTIFY=",
]
NASTY = [b"\x00", b"\xff\xfe", b"\xc3\x28", b"\r", b"\n", b" ", b"<", b">", b"@", b"\\", b'"', b"."]

arguments = st.lists(
    st.one_of(st.sampled_from(NASTY), st.binary(max_size=40), st.text(max_size=20).map(str.encode)),
    max_size=8,
).map(b"".join)
command_lines = st.one_of(
    st.tuples(st.sampled_from(VERBS), arguments).map(lambda t: t[0] + b" " + t[1]),
    st.binary(max_size=60),
    st.integers(min_value=900, max_value=3000).map(lambda n: b"X" * n),
)
body_pieces = st.one_of(
    st.sampled_from(
        [b"\n", b"\r", b"\r\n", b"\x00", b".", b"..", b"\r\n.", b"\n.\n", b"\n.\r\n", b"\xff\xfe"]
    ),
    st.binary(max_size=80),
    st.integers(min_value=990, max_value=5000).map(lambda n: b"y" * n),
)
# Lines for the round trip: no CR or LF inside, at most 998 octets (RFC 5321 4.5.3.1.6).
body_lines = st.lists(
    st.one_of(
        st.sampled_from([b"", b".", b"..", b"...", b". ", b".x", b"\x00", b"\xff", b"From x"]),
        st.binary(max_size=120).filter(lambda b: b"\r" not in b and b"\n" not in b),
        st.binary(max_size=40)
        .filter(lambda b: b"\r" not in b and b"\n" not in b)
        .map(lambda b: b"." + b),
    ),
    max_size=30,
)
ONE_MEGABYTE_LINE = b"z" * (1024 * 1024)


@pytest.fixture
async def server(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> AsyncIterator[Running]:
    settings_ = make_settings(
        tmp_path,
        db_url,
        make_tls(tmp_path),
        modes=("relay", "submission"),
        command_timeout=5,
        data_timeout=5,
        max_message_size=2_000_000,
    )
    async with running_service(settings_, pool) as running:
        yield running


def converse(port: int, payload: bytes, *, wait: float = 5) -> bytes:
    """Send `payload` in one go, read whatever comes back until the server hangs up or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.settimeout(wait)
        try:
            s.sendall(payload)
        except OSError:
            pass  # the server may hang up first (too many bad commands)
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except (TimeoutError, OSError):
            pass
        return received


def assert_responsive(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.settimeout(30)
        reader = s.makefile("rb")
        assert reader.readline().startswith(b"220 ")
        s.sendall(b"NOOP\r\n")
        assert reader.readline().startswith(b"250 ")


class ErrorCounter(logging.Handler):
    """Counts errors logged by pigeon-mta, so each example can check it caused none (and
    hypothesis can shrink the one that did)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {record.exc_info[1]!r}"
        self.messages.append(text)


@pytest.fixture
def logged_errors() -> Iterator[ErrorCounter]:
    counter = ErrorCounter()
    logger = logging.getLogger("pigeon_mta")
    logger.addHandler(counter)
    try:
        yield counter
    finally:
        logger.removeHandler(counter)


def assert_no_new_errors(counter: ErrorCounter, before: int) -> None:
    assert counter.messages[before:] == []


async def test_random_command_lines(server: Running, logged_errors: ErrorCounter) -> None:
    ports = [server.port("relay"), server.port("submission")]

    @FUZZ_SETTINGS
    @given(lines=st.lists(command_lines, max_size=12), listener=st.sampled_from([0, 1]))
    @example(lines=[b"EHLO x", b"AUTH LOGIN", ONE_MEGABYTE_LINE], listener=0)
    @example(lines=[b"MAIL FROM:<\x00@x>", b"RCPT TO:<\xff@y>", b"EHLO \x00\xff"], listener=0)
    def check(lines: list[bytes], listener: int) -> None:
        port = ports[listener]
        before = len(logged_errors.messages)
        # The trailing dot and QUIT end any DATA the random lines may have opened.
        converse(port, b"\r\n".join(lines) + b"\r\n.\r\nQUIT\r\n", wait=1)
        assert_responsive(port)
        assert_no_new_errors(logged_errors, before)

    await asyncio.to_thread(check)
    assert logged_errors.messages == []


async def test_random_data_bodies(server: Running, logged_errors: ErrorCounter) -> None:
    port = server.port("relay")

    @FUZZ_SETTINGS
    @given(pieces=st.lists(body_pieces, max_size=20))
    @example(pieces=[b"Subject: x\r\n\r\n", ONE_MEGABYTE_LINE, b"\r\n"])
    @example(pieces=[b"a\n.\nMAIL FROM:<smuggled@x.example>\r\n"])
    def check(pieces: list[bytes]) -> None:
        before = len(logged_errors.messages)
        head = b"EHLO fuzz\r\nMAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n"
        transcript = converse(port, head + b"".join(pieces) + b"\r\n.\r\nQUIT\r\n")
        assert transcript.startswith(b"220 ")
        assert_responsive(port)
        assert_no_new_errors(logged_errors, before)

    await asyncio.to_thread(check)
    assert logged_errors.messages == []


async def test_dot_stuffed_bodies_come_through_unchanged(
    server: Running, logged_errors: ErrorCounter
) -> None:
    port = server.port("relay")
    loop = asyncio.get_running_loop()

    examples = itertools.count()

    @FUZZ_SETTINGS
    @given(lines=body_lines)
    def check(lines: list[bytes]) -> None:
        # A Message-ID of its own for each example: the same one again would be a duplicate
        # submission, answered with the first one's queue id (limits.duplicate_window).
        original = b"Message-ID: <fuzz-%d@test>\r\n" % next(examples)
        original += b"Date: Mon, 1 Jan 2024 00:00:00 +0000\r\n\r\n"
        original += b"".join(line + b"\r\n" for line in lines)
        stuffed = b"".join(
            (b"." + line if line.startswith(b".") else line) + b"\r\n"
            for line in original[:-2].split(b"\r\n")
        )
        head = b"EHLO fuzz\r\nMAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nDATA\r\n"
        transcript = converse(port, head + stuffed + b".\r\nQUIT\r\n")
        assert b"250 2.0.0 Ok: queued as " in transcript, transcript
        queue_id = transcript.split(b"queued as ", 1)[1].split(b"\r\n", 1)[0].decode()
        stored = asyncio.run_coroutine_threadsafe(
            server.pool.fetchval("SELECT body FROM message WHERE id = $1::uuid", queue_id), loop
        ).result(30)
        assert bytes(stored).endswith(original)
        assert bytes(stored).startswith(b"Received: ")

    await asyncio.to_thread(check)
    assert logged_errors.messages == []


async def test_pipelined_starttls_after_a_timed_out_handshake(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, logged_errors: ErrorCounter
) -> None:
    """Found by the fuzzer: the command timer firing during a TLS handshake that never starts,
    with a second STARTTLS already in the buffer, made aiosmtpd stack TLS on a closed transport."""
    settings_ = make_settings(
        tmp_path, db_url, make_tls(tmp_path), modes=("relay",), command_timeout=0.3
    )
    async with running_service(settings_, pool) as running:
        port = running.port("relay")
        for _ in range(5):
            await asyncio.to_thread(
                converse,
                port,
                b"RSET\r\nSTARTTLS\r\ngarbage\r\nSTARTTLS\r\n\r\n.\r\nQUIT\r\n",
                wait=1,
            )
            await asyncio.to_thread(assert_responsive, port)
    assert logged_errors.messages == []
