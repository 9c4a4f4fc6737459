"""One SMTP connection: aiosmtpd's `SMTP` protocol with our connection accounting, timers and
reply codes around it."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import typing
from collections.abc import Awaitable, Callable
from typing import Any

from aiosmtpd.smtp import SMTP, Session, syntax

from pigeon_mta.intake.addresses import client_address, in_networks, split_path
from pigeon_mta.metrics import SMTP_REJECTIONS
from pigeon_mta.submission import replies
from pigeon_mta.submission.context import Conversation, ListenerContext
from pigeon_mta.submission.data import DataProblem, read_data
from pigeon_mta.submission.handler import names_with_prefixes
from pigeon_mta.submission.mail_params import Malformed, TransactionEnvelope, take_auth_param

log = logging.getLogger("pigeon_mta.submission")

GREETING_IDENT = "ESMTP pigeon-mta"
# The reader's limit while reading DATA (see smtp_DATA).
DATA_READ_LIMIT = 256 * 1024


class _QuietSession(Session):
    """aiosmtpd sets the deprecated `login_data` on every successful AUTH, and its property logs
    a warning each time; we never read it."""

    @property
    def login_data(self) -> Any:
        return self._login_data

    @login_data.setter
    def login_data(self, value: Any) -> None:
        self._login_data = value


class SMTPSession(SMTP):
    def __init__(self, handler: Any, ctx: ListenerContext) -> None:
        """`handler`: a SubmissionHandler, or a feedback listener's FeedbackHandler."""
        implicit_tls = ctx.mode == "submissions"
        plaintext_auth = ctx.plaintext_auth
        super().__init__(
            handler,
            data_size_limit=ctx.limits.max_message_size or None,
            enable_SMTPUTF8=True,
            decode_data=False,
            hostname=ctx.hostname,
            ident=GREETING_IDENT,
            tls_context=None if implicit_tls else ctx.tls.context,
            # RFC 6409 submission: nothing but EHLO/NOOP/QUIT/STARTTLS before TLS.
            require_starttls=ctx.mode == "submission" and not plaintext_auth,
            timeout=ctx.limits.command_timeout,
            auth_required=False,  # decided per command by the handler (trusted networks)
            auth_require_tls=not (implicit_tls or plaintext_auth),
            loop=asyncio.get_running_loop(),
        )
        self.ctx = ctx
        self.conversation = Conversation(client_ip="unknown", trusted=False)
        self.enqueuing = 0  # commits under way; stop() waits for them
        # aiosmtpd keeps command_size_limits on the class, shared by every connection; give each
        # connection its own.
        self.command_size_limits: collections.defaultdict[str, int] = collections.defaultdict(
            lambda: SMTP.command_size_limit
        )
        self._counted = False
        self._refused = False
        self.junk_commands = 0  # since the connection opened or its last queued message
        self._in_junk_command = False  # its replies are not counted again

    def __dir__(self) -> list[str]:
        # aiosmtpd's constructor looks through dir() of the connection for its smtp_* commands
        # and auth_* mechanisms, with inspect.getmembers, on every new connection: a third of
        # the cost of a connection. Listing just those names keeps the lookup and cuts the cost.
        return names_with_prefixes(type(self), ("smtp_", "auth_"))

    # ------------------------------------------------------------ connection

    def _create_session(self) -> Session:
        return _QuietSession(self.loop)

    def _create_envelope(self) -> TransactionEnvelope:
        return TransactionEnvelope()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._counted:
            if not self._admit(transport):
                return
        else:
            # After STARTTLS the client starts over (RFC 3207 4.2): forget HELO and AUTH.
            self.conversation = Conversation(
                client_ip=self.conversation.client_ip, trusted=self.conversation.trusted
            )
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            cipher = ssl_object.cipher()
            self.conversation.tls_version = ssl_object.version()
            self.conversation.tls_cipher = cipher[0] if cipher else None

    def _admit(self, transport: asyncio.BaseTransport) -> bool:
        ip = client_address(transport.get_extra_info("peername"))
        ip_text = str(ip) if ip is not None else "unknown"
        _set_nodelay(transport)
        refusal = None
        if self.ctx.shutting_down:
            refusal, reason = replies.SHUTTING_DOWN, "shutting_down"
        elif not self.ctx.connections.acquire(ip_text):
            refusal, reason = replies.TOO_MANY_CONNECTIONS, "too_many_connections"
            log.warning("refused a connection from [%s]: too many open", ip_text)
        if refusal is not None:
            self._refused = True
            SMTP_REJECTIONS.labels(listener=self.ctx.name, reason=reason).inc()
            _say_and_close(transport, refusal.format(hostname=self.ctx.hostname))
            return False
        self._counted = True
        trusted = self.ctx.mode == "relay" and in_networks(ip, self.ctx.trusted_networks)
        self.conversation = Conversation(client_ip=ip_text, trusted=trusted)
        self.ctx.sessions.add(self)
        return True

    def connection_lost(self, error: Exception | None) -> None:
        if self._refused:
            return
        if self._counted:
            self._counted = False
            self.ctx.connections.release(self.conversation.client_ip)
            self.ctx.sessions.discard(self)
        super().connection_lost(error)

    def close_with(self, reply: str) -> None:
        """Say `reply` (a 421) and hang up."""
        if self.transport is not None:
            _say_and_close(self.transport, reply.format(hostname=self.ctx.hostname))

    # ------------------------------------------------------------ MAIL

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        # aiosmtpd checks SIZE, BODY and SMTPUTF8 and refuses any other parameter with a 555.
        # RFC 4954 section 5: a server that offers AUTH accepts MAIL's AUTH= parameter, so it is
        # taken off here (before aiosmtpd upper-cases the mailbox in it) and kept with the
        # transaction; without EHLO aiosmtpd refuses any parameter.
        assert self.session is not None and self.envelope is not None
        if arg is None or not self.session.extended_smtp:
            await super().smtp_MAIL(arg)
            return
        arg, auth_param = take_auth_param(arg)
        if auth_param is Malformed.AUTH:
            await self.push(replies.BAD_AUTH_PARAM)
            return
        if not self.envelope.mail_from:  # a nested MAIL leaves the transaction as it is
            typing.cast(TransactionEnvelope, self.envelope).auth_param = auth_param
        await super().smtp_MAIL(arg)

    # ------------------------------------------------------------ DATA and timers

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        if await self.check_helo_needed():
            return
        assert self.envelope is not None
        if not self.envelope.rcpt_tos:
            await self.push(replies.NEED_RCPT)
            return
        if arg:
            await self.push(replies.DATA_SYNTAX)
            return
        # The whole DATA phase gets data_timeout, so a slow sender is cut off in the end.
        self._reset_timeout(self.ctx.limits.data_timeout)
        await self.push(replies.START_DATA)
        # asyncio.StreamReader's limit is aiosmtpd's line limit (1001): past twice that, the
        # reader pauses the socket, and a message would pause and resume it every 2 KB.
        reader = self._reader
        reader._limit = DATA_READ_LIMIT  # type: ignore[attr-defined]
        try:
            data = await read_data(
                reader,
                max_size=self.data_size_limit,
                fold=self.ctx.limits.long_lines == "fold",
            )
        finally:
            reader._limit = self.line_length_limit  # type: ignore[attr-defined]
        if data.problem is not None:
            self._set_post_data_state()  # type: ignore[no-untyped-call]
            await self.push(
                replies.MESSAGE_TOO_BIG
                if data.problem is DataProblem.TOO_BIG
                else replies.LINE_TOO_LONG
            )
            return
        self.envelope.content = self.envelope.original_content = data.content
        status = await self._call_handler_hook("DATA")
        if isinstance(status, str) and status.startswith("250"):
            self.junk_commands = 0
        if data.folded:
            log.info(
                "%d line(s) over 998 octets folded (limits.long_lines) in the message from [%s]: %s",
                data.folded,
                self.conversation.client_ip,
                status,
            )
        self._set_post_data_state()  # type: ignore[no-untyped-call]
        await self.push(status)

    def restart_command_timer(self) -> None:
        self._reset_timeout()

    def _timeout_cb(self) -> None:
        SMTP_REJECTIONS.labels(listener=self.ctx.name, reason="timeout").inc()
        log.info("closing an idle connection from [%s]", self.conversation.client_ip)
        if self.transport is not None and not self.transport.is_closing():
            _say(self.transport, replies.TIMEOUT.format(hostname=self.ctx.hostname))
            super()._timeout_cb()  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------ TLS

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg: str) -> None:
        # aiosmtpd would start a second TLS layer (and fail) on a repeated STARTTLS; RFC 3207 4.2
        # makes it a bad sequence once TLS was started (or tried).
        if self._tls_protocol is not None:
            await self.push(replies.TLS_ALREADY_ACTIVE)
            return
        await super().smtp_STARTTLS(arg)

    # ------------------------------------------------------------ parsing

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        # aiosmtpd parses paths with the stdlib's RFC 5322 header parser: slow (a tenth of the
        # time per message), lenient (comments, folding) and it raises IndexError on input such
        # as "<a@". The address found here is checked strictly by addresses.parse_mailbox.
        return split_path(arg)

    # ------------------------------------------------------------ replies

    async def handle_exception(self, error: Exception) -> str:
        # A hook failed half-way: start the transaction over, as after RSET, so that the client's
        # next MAIL is not "nested".
        self._set_rset_state()  # type: ignore[no-untyped-call]
        return await super().handle_exception(error)

    # Our own HELO and EHLO: aiosmtpd inspects the signature of an EHLO hook on every new
    # connection, and sends each EHLO line in its own write.

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str) -> None:
        await self._junk(self._ehlo, hostname)

    async def _ehlo(self, hostname: str) -> None:
        if not hostname:
            await self.push(replies.EHLO_SYNTAX)
            return
        self._greet(hostname, esmtp=True)
        lines = [self.hostname]
        if self.data_size_limit:
            lines.append(f"SIZE {self.data_size_limit}")
        lines += ["8BITMIME", "SMTPUTF8", "PIPELINING", "ENHANCEDSTATUSCODES"]
        if self.tls_context and not self._tls_protocol:
            lines.append("STARTTLS")
        if not self._auth_require_tls or self._tls_protocol:
            lines.append("AUTH " + " ".join(sorted(self._auth_methods)))
        # RFC 1869 4.7: extensions' MAIL parameters lengthen the MAIL command (SIZE=, SMTPUTF8,
        # BODY=8BITMIME, and 500 for AUTH= by RFC 4954 section 5).
        self.command_size_limits["MAIL"] = SMTP.command_size_limit + 26 + 10 + 14 + 500
        text = "\r\n".join(f"250-{x}" for x in lines[:-1]) + f"\r\n250 {lines[-1]}"
        await super().push(text.encode("ascii", "replace"))

    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str) -> None:
        await self._junk(self._helo, hostname)

    async def _helo(self, hostname: str) -> None:
        if not hostname:
            await self.push(replies.HELO_SYNTAX)
            return
        self._greet(hostname, esmtp=False)
        await super().push(f"250 {self.hostname}".encode("ascii", "replace"))

    def _greet(self, hostname: str, *, esmtp: bool) -> None:
        """A new HELO/EHLO resets the transaction (RFC 5321 4.1.4)."""
        self._set_rset_state()  # type: ignore[no-untyped-call]
        assert self.session is not None
        self.session.extended_smtp = esmtp
        self.session.host_name = hostname
        self.conversation.helo = hostname
        self.conversation.esmtp = esmtp

    async def push(self, status: Any) -> None:
        if isinstance(status, str):
            status = replies.with_enhanced_code(status)
            if status[:1] in ("4", "5"):
                reason = replies.rejection_reason(status)
                if (
                    reason in replies.JUNK_REASONS
                    and not self._in_junk_command
                    and self._count_junk()
                ):
                    return
                SMTP_REJECTIONS.labels(listener=self.ctx.name, reason=reason).inc()
            # Some aiosmtpd replies echo the client's argument, which may hold bytes that were
            # not UTF-8 (kept as surrogates): escape rather than fail.
            status = status.encode("ascii", "backslashreplace")
        await super().push(status)

    # ------------------------------------------------------------ junk commands

    # Commands that move no message forward. A connection may send limits.max_junk_commands of
    # them between the messages it gets queued, as Postfix's smtpd_junk_command_limit, else a
    # NOOP now and then keeps it open for ever. Junk are NOOP, RSET, VRFY, EXPN, HELP (Postfix's
    # set, less ETRN, which is not offered), HELO and EHLO (as Exim's smtp_accept_max_nonmail:
    # a client needs one or two per connection), and every command whose refusal is one of
    # replies.JUNK_REASONS, counted in push(). aiosmtpd closes a connection after five unknown
    # commands on its own (502 5.5.1).

    @syntax("NOOP [ignored]")
    async def smtp_NOOP(self, arg: str) -> None:
        await self._junk(super().smtp_NOOP, arg)

    @syntax("RSET")
    async def smtp_RSET(self, arg: str) -> None:
        await self._junk(super().smtp_RSET, arg)

    @syntax("VRFY <address>")
    async def smtp_VRFY(self, arg: str) -> None:
        await self._junk(super().smtp_VRFY, arg)

    async def smtp_EXPN(self, arg: str) -> None:
        await self._junk(super().smtp_EXPN, arg)

    @syntax("HELP [command]")
    async def smtp_HELP(self, arg: str) -> None:
        await self._junk(super().smtp_HELP, arg)

    async def _junk(self, command: Callable[[str], Awaitable[Any]], arg: str) -> None:
        """Run a junk command, counted once whatever it answers; or hang up if it is one too
        many."""
        if self._count_junk():
            return
        self._in_junk_command = True
        try:
            await command(arg)
        finally:
            self._in_junk_command = False

    def _count_junk(self) -> bool:
        """Count one junk command; True when it is one too many: the connection is then closed
        with a 421 (RFC 5321 3.8) instead of its reply."""
        self.junk_commands += 1
        limit = self.ctx.limits.max_junk_commands
        if not limit or self.junk_commands <= limit:
            return False
        SMTP_REJECTIONS.labels(listener=self.ctx.name, reason="junk_commands").inc()
        log.warning(
            "closing the connection from [%s]: more than %d junk commands (limits.max_junk_commands)",
            self.conversation.client_ip,
            limit,
        )
        self.close_with(replies.TOO_MANY_JUNK_COMMANDS)
        return True


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    # Replies are small writes followed by a read: without TCP_NODELAY each waits for Nagle.
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def _say(transport: asyncio.BaseTransport, reply: str) -> None:
    # uvloop's transports are not asyncio.WriteTransport subclasses, but they all write.
    typing.cast(asyncio.WriteTransport, transport).write(reply.encode() + b"\r\n")


def _say_and_close(transport: asyncio.BaseTransport, reply: str) -> None:
    # Closing twice is not harmless: a second close() of an asyncio TLS transport drops its
    # protocol.
    if transport.is_closing():
        return
    _say(transport, reply)
    transport.close()
