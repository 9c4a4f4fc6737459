"""One SMTP transaction: a message and its recipients at one destination -> one result per recipient.

MAIL, one RCPT per recipient (each reply kept: some may be accepted and others refused in the same
transaction), DATA for the accepted ones, the final dot. Errors never escape: a refused command, a
dropped connection or a timeout becomes that recipient's result, with the stage it happened at, for
`classify` to judge.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import aiosmtplib

from pigeon_mta.domains import ascii_domain
from pigeon_mta.model import ClaimedRecipient, Reply
from pigeon_mta.outbound.classify import Stage, parse_reply
from pigeon_mta.outbound.connect import SmtpConnection
from pigeon_mta.outbound.pool import Connected, NotConnected

_BARE_LINE_END = re.compile(rb"\r(?!\n)|(?<!\r)\n")

SMTP_ERRORS = (aiosmtplib.SMTPException, OSError, TimeoutError)


@dataclass(frozen=True)
class Peer:
    """Where a transaction went, for the attempt log."""

    host: str | None
    ip: str | None
    port: int | None
    tls_version: str | None = None
    tls_cipher: str | None = None


@dataclass(frozen=True)
class RecipientResult:
    recipient: ClaimedRecipient
    stage: Stage
    result: Reply | BaseException


@dataclass(frozen=True)
class TransactionResult:
    results: tuple[RecipientResult, ...]
    peer: Peer
    duration: float  # from the first connection try to the final reply
    # When the final reply arrived (wall clock): the time of the attempt's event. The claim, the
    # route and the destination's limits come before `duration` starts, so a start taken before
    # them plus `duration` would fall before the receiver had answered.
    finished_at: datetime
    reusable: bool  # the connection may carry another message
    reused: bool  # the transaction ran on a connection that had carried one before

    @property
    def stale_connection(self) -> bool:
        """A reused connection was found dead before MAIL got a reply: nothing was sent, and a
        fresh connection deserves the transaction."""
        return self.reused and all(
            r.stage == "mail" and isinstance(r.result, ConnectionError) for r in self.results
        )


def wire_message(body: bytes) -> bytes:
    """The message as sent after DATA: CRLF line ends, dot-stuffed (RFC 5321 4.5.2), final dot."""
    # Queued bodies normally have CRLF line ends already; counting is much cheaper than a regex.
    crlf = body.count(b"\r\n")
    if body.count(b"\n") != crlf or body.count(b"\r") != crlf:
        body = _BARE_LINE_END.sub(b"\r\n", body)
    if not body.endswith(b"\r\n"):
        body += b"\r\n"
    body = body.replace(b"\r\n.", b"\r\n..")
    if body.startswith(b"."):
        body = b"." + body
    return body + b".\r\n"


def not_connected(
    recipients: Sequence[ClaimedRecipient], failure: NotConnected, started: float
) -> TransactionResult:
    return TransactionResult(
        results=tuple(RecipientResult(r, failure.stage, failure.result) for r in recipients),
        peer=Peer(failure.host, failure.ip, failure.port),
        duration=time.monotonic() - started,
        finished_at=datetime.now(UTC),
        reusable=False,
        reused=False,
    )


async def transact(
    connected: Connected,
    *,
    sender: str,
    recipients: Sequence[ClaimedRecipient],
    message: bytes,
    command_timeout: float,
    data_timeout: float,
    started: float,
    on_data_sent: Callable[[Sequence[uuid.UUID]], None] = lambda _ids: None,
) -> TransactionResult:
    """Run one transaction on an open connection. `message` is the output of `wire_message`.

    With PIPELINING (RFC 2920) MAIL, every RCPT and DATA go out in one write and their replies are
    read back in order; without it, each command waits for its reply."""
    conn = connected.connection
    results: dict[uuid.UUID, RecipientResult] = {}
    stage: Stage = "mail"
    accepted: list[ClaimedRecipient] = []
    reusable = True

    def finish(
        reply_or_error: Reply | BaseException, at: Stage, who: Sequence[ClaimedRecipient]
    ) -> None:
        for r in who:
            results.setdefault(r.id, RecipientResult(r, at, reply_or_error))

    try:
        wire = conn.wire
        if wire is None:
            raise aiosmtplib.SMTPServerDisconnected("the connection was never set up")
        utf8 = _needs_utf8(sender) or any(_needs_utf8(r.address) for r in recipients)
        if utf8 and not conn.supports("smtputf8"):
            refusal = Reply(
                0,
                "5.6.7",
                f"{conn.key.host} does not support SMTPUTF8 (RFC 6531), "
                "which this message's addresses need",
            )
            finish(refusal, "mail", recipients)
            return _result(conn, results, recipients, started, connected.reused, True)
        mail = b" ".join(
            [b"MAIL FROM:<" + _address(sender, utf8) + b">", *_mail_options(conn, message, utf8)]
        )
        rcpts = [b"RCPT TO:<" + _address(r.address, utf8) + b">" for r in recipients]
        pipelined = conn.supports("pipelining")
        if pipelined:
            wire.write(b"\r\n".join([mail, *rcpts, b"DATA", b""]))
            mail_reply = await wire.read(command_timeout)
        else:
            mail_reply = await wire.command(mail, command_timeout)
        if pipelined or mail_reply.code == 250:
            stage = "rcpt"
            for r, rcpt in zip(recipients, rcpts, strict=True):
                reply = await (
                    wire.read(command_timeout) if pipelined else wire.command(rcpt, command_timeout)
                )
                if reply.code in (250, 251):
                    accepted.append(r)
                else:
                    finish(parse_reply(reply.code, reply.message), "rcpt", [r])
        if mail_reply.code != 250:
            # Any RCPT a pipelining server answered 250 after a refused MAIL means nothing.
            accepted.clear()
            results.clear()
            finish(parse_reply(mail_reply.code, mail_reply.message), "mail", recipients)
        if pipelined or accepted:
            stage = "data"
            data_reply = await (
                wire.read(command_timeout) if pipelined else wire.command(b"DATA", command_timeout)
            )
        if not accepted:
            if pipelined and data_reply.code == 354:
                # RFC 2920 3.1: a server that took DATA anyway gets an empty message, ended at
                # once; such a server is not trusted with another transaction.
                wire.write(b".\r\n")
                await wire.read(command_timeout)
                reusable = False
            else:
                reusable = await conn.reset(command_timeout)
            return _result(conn, results, recipients, started, connected.reused, reusable)
        if data_reply.code != 354:
            finish(parse_reply(data_reply.code, data_reply.message), "data", accepted)
            reusable = await conn.reset(command_timeout)
            return _result(conn, results, recipients, started, connected.reused, reusable)
        stage = "dot"
        on_data_sent([r.id for r in accepted])
        wire.write(message)
        response = await wire.read(data_timeout)
        conn.transactions += 1
        finish(parse_reply(response.code, response.message), "dot", accepted)
        if response.code == 421:
            reusable = False  # the server is closing the connection (RFC 5321 3.8)
    except SMTP_ERRORS as exc:
        reusable = False
        conn.abort()
        # Every recipient not yet answered (accepted ones included) gets the error at its stage.
        finish(exc, stage, recipients)
    return _result(conn, results, recipients, started, connected.reused, reusable)


def _result(
    conn: SmtpConnection,
    results: dict[uuid.UUID, RecipientResult],
    recipients: Sequence[ClaimedRecipient],
    started: float,
    reused: bool,
    reusable: bool,
) -> TransactionResult:
    key = conn.key
    return TransactionResult(
        results=tuple(results[r.id] for r in recipients),
        peer=Peer(key.host, key.ip, key.port, conn.tls_version, conn.tls_cipher),
        duration=time.monotonic() - started,
        finished_at=datetime.now(UTC),
        reusable=reusable and conn.usable,
        reused=reused,
    )


def _mail_options(conn: SmtpConnection, message: bytes, utf8: bool) -> list[bytes]:
    options: list[bytes] = []
    if conn.supports("size"):
        options.append(b"SIZE=%d" % len(message))
    if conn.supports("8bitmime") and not message.isascii():
        options.append(b"BODY=8BITMIME")
    if utf8:
        options.append(b"SMTPUTF8")
    return options


def _needs_utf8(address: str) -> bool:
    """A non-ASCII local part needs SMTPUTF8; a non-ASCII domain can be sent as A-labels."""
    return not address.rpartition("@")[0].isascii()


def _address(address: str, utf8: bool) -> bytes:
    """The address for MAIL/RCPT: as is with SMTPUTF8, else with its domain in A-label form."""
    if utf8 or address.isascii() or "@" not in address:
        return address.encode("utf-8")
    local, _, domain = address.rpartition("@")
    try:
        return f"{local}@{ascii_domain(domain)}".encode()
    except ValueError:
        return address.encode("utf-8")
