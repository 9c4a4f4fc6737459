"""Commands out and replies in on an open client connection, pipelined when the server allows it.

aiosmtplib opens a connection (greeting, EHLO, STARTTLS, AUTH: connect.py); then `Wire` takes over
its transport for the mail transactions. aiosmtplib's own protocol expects one reply per read and
drops what follows it in the same segment, so it cannot pipeline (RFC 2920: MAIL, every RCPT and
DATA in one write, the replies read back in order). `Wire` keeps every complete reply it receives,
in order, until it is read. Pipelining saves two round trips per message: over a WAN that is
latency, on loopback it is CPU (each round trip wakes both processes).

Errors are aiosmtplib's (a ConnectionError for a lost connection, a TimeoutError for a reply that
did not come), so `classify` judges them as it judges errors from the set-up.
"""

from __future__ import annotations

import asyncio
import collections
import re
import typing

from aiosmtplib import SMTPReadTimeoutError, SMTPResponse, SMTPServerDisconnected

# A reply line, or a whole multi-line reply, longer than this is not SMTP (RFC 5321 4.5.3.1.5
# allows 512 octets a line; this leaves room for the generous).
MAX_LINE = 8192
MAX_REPLY = 4 * MAX_LINE
# A reply line's code: three ASCII digits (RFC 5321 4.2).
_CODE = re.compile(rb"[0-9]{3}")


class NotSmtp(SMTPServerDisconnected):
    """The peer sent something no SMTP server sends (a line without a reply code, a reply too
    long); the connection is closed, and the transaction's recipients are deferred."""


class Wire(asyncio.Protocol):
    """The protocol of a connection's transport once the connection is set up."""

    def __init__(self, transport: asyncio.BaseTransport, previous: asyncio.BaseProtocol) -> None:
        """Take `transport` over from `previous` (aiosmtplib's protocol), which still hears about
        the connection's end so that aiosmtplib's view of it stays true."""
        self._transport = typing.cast(asyncio.Transport, transport)
        self._previous = previous
        self._buffer = bytearray()
        self._replies: collections.deque[SMTPResponse] = collections.deque()
        self._lost: SMTPServerDisconnected | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._transport.set_protocol(self)

    # ------------------------------------------------------------ asyncio.Protocol

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._parse()
        except NotSmtp as exc:
            self._end(exc)
            self._transport.abort()
            return
        self._wake()

    def eof_received(self) -> bool:
        self._end(SMTPServerDisconnected("the server closed the connection"))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(SMTPServerDisconnected(f"connection lost: {exc}" if exc else "connection lost"))
        self._previous.connection_lost(exc)

    # ------------------------------------------------------------ commands and replies

    @property
    def connected(self) -> bool:
        return self._lost is None and not self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if self._lost is not None:
            raise self._lost
        if self._transport.is_closing():
            raise SMTPServerDisconnected("the connection is closing")
        self._transport.write(data)

    async def read(self, timeout: float) -> SMTPResponse:
        """The next reply, in the order the commands went out."""
        if not self._replies and self._lost is None:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            # A timer that fails the waiter: asyncio.wait_for would wrap this wait in another
            # future and two callbacks, and it runs twice per message.
            timer = loop.call_later(timeout, _time_out, waiter, timeout)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self._replies:
            return self._replies.popleft()
        assert self._lost is not None
        raise self._lost

    async def command(self, line: bytes, timeout: float) -> SMTPResponse:
        """One command (without its CRLF) and its reply."""
        self.write(line + b"\r\n")
        return await self.read(timeout)

    def close(self) -> None:
        self._transport.close()

    # ------------------------------------------------------------ parsing

    def _parse(self) -> None:
        """Move every complete reply out of the buffer (RFC 5321 4.2.1: "xyz-text" lines continue a
        reply, "xyz text" ends it)."""
        buffer = self._buffer
        while True:
            start = 0
            lines: list[bytes] = []
            while True:
                end = buffer.find(b"\n", start)
                if end < 0:
                    if len(buffer) - start > MAX_LINE or len(buffer) > MAX_REPLY:
                        raise NotSmtp("the server sent a line too long for SMTP")
                    return
                line = bytes(buffer[start:end]).rstrip(b"\r")
                start = end + 1
                if len(line) > MAX_LINE or start > MAX_REPLY:
                    raise NotSmtp("the server sent a reply too long for SMTP")
                if not _CODE.fullmatch(line[:3]) or line[3:4] not in (b"", b" ", b"-"):
                    text = line[:80].decode("utf-8", "backslashreplace")
                    raise NotSmtp(f"the server sent a line that is not an SMTP reply: {text!r}")
                lines.append(line)
                if line[3:4] != b"-":
                    break
            del buffer[:start]
            self._replies.append(_reply(lines))

    def _end(self, exc: SMTPServerDisconnected) -> None:
        if self._lost is None:
            self._lost = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self._replies or self._lost):
            waiter.set_result(None)


def _time_out(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(
            SMTPReadTimeoutError(f"timed out waiting {timeout:g} s for the server's reply")
        )


def _reply(lines: list[bytes]) -> SMTPResponse:
    """One reply from its lines: the code of the last line, the texts joined by newlines (as
    aiosmtplib gives them; undecodable bytes kept as surrogates, cleaned before they are stored)."""
    return SMTPResponse(
        int(lines[-1][:3]),
        "\n".join(line[4:].strip(b" \t").decode("utf-8", "surrogateescape") for line in lines),
    )
