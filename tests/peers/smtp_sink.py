"""SMTP sinks on loopback whose behaviour each recipient chooses by its local part.

    engine under test --SMTP--> SmtpSink 127.0.0.2:<port>, 127.0.0.3:<port>, ... (one SinkState)

The local part up to a "+" names the behaviour (`tempfail+7@example.test`):

    anything else    accept
    tempfail         451 4.7.1 at RCPT the first time this address is seen, then accept
    reject-rcpt      550 5.1.1 at RCPT
    full             552 5.2.2 at RCPT (a client must treat it as 452)
    reject-data      554 5.6.0 after the final dot (for every recipient of the message)
    drop-mid-data    the first time: 354, then the connection is cut while the client sends
    drop-after-dot   the first time: the whole message is read, then the connection is cut
                     before the reply (the message counts as received: a possible duplicate)
    slow             the reply to the final dot waits `slow_seconds`
    held             the reply to the final dot waits until the test sets `release`
    hang-data        the first time: the whole message is read, then the final dot never gets a
                     reply (until the client goes away); afterwards accept
    hang             RCPT never gets a reply (until the client goes away)
    slow-down        421 4.7.0 at RCPT the first time this address is seen, stating a retry
                     delay of `stated_delay` seconds ("try again in N seconds"), then accept
    blocked          550 5.7.1 at RCPT the first time this address is seen, saying the sending
                     network is on the server's block list (Microsoft's S3150), then accept

A SinkState with `throttle_above = N` answers MAIL with `421 4.7.0 Try again later` while it
accepted N MAIL commands within the last second, as a provider throttling a sender does.

A sink offers PIPELINING (RFC 2920) unless started with `pipelining=False`. It can also greet with a refusal (`greeting="421 ..."`), offer STARTTLS (trustme certificate),
break the TLS handshake after its "220 Ready", and require AUTH. The shared SinkState counts
connections, messages and per-recipient deliveries, the highest number of transactions in flight
and of SMTP sessions open at once (from the connection to its QUIT or loss).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session


@dataclass
class ReceivedMessage:
    sink: str  # the address the sink listens on
    mail_from: str
    rcpt_tos: list[str]
    data: bytes
    tls: bool
    auth_user: str | None
    replied: bool  # False when the sink cut the connection instead of answering
    helo: str | None = None  # the client's EHLO name
    at: float = field(default_factory=time.time)
    replied_at: float | None = None  # when the sink sent its 250 for the message (time.time())


@dataclass
class SinkState:
    slow_seconds: float = 1.0
    stated_delay: int = 10  # what a `slow-down` recipient's 421 says to wait
    connections: collections.Counter[str] = field(default_factory=collections.Counter)
    messages: list[ReceivedMessage] = field(default_factory=list)
    seen: collections.Counter[str] = field(default_factory=collections.Counter)
    rcpt_commands: collections.Counter[str] = field(default_factory=collections.Counter)
    # Every AUTH the sinks were sent, right or wrong: (sink, login, password).
    auth_attempts: list[tuple[str, str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    sessions: int = 0
    max_sessions: int = 0
    # Throttling (see the module docstring): 0 = never; the times of accepted MAIL commands and
    # of the 421 replies.
    throttle_above: int = 0
    mail_times: collections.deque[float] = field(default_factory=collections.deque)
    throttled: list[float] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # What the final dot of a `held` recipient waits for.
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def deliveries(self) -> collections.Counter[str]:
        """How many times each address received a message that the sink answered with 250."""
        counts: collections.Counter[str] = collections.Counter()
        for message in self.messages:
            if message.replied:
                counts.update(message.rcpt_tos)
        return counts

    def received_by(self, address: str) -> list[ReceivedMessage]:
        return [m for m in self.messages if address in m.rcpt_tos]

    async def wait_for(self, predicate: Any, timeout: float = 60) -> None:
        """Wait until predicate() is true (checked whenever the sink sees something)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"sink condition not met within {timeout}s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.2))

    def _note(self) -> None:
        self.changed.set()


def behaviour(address: str) -> str:
    return address.rpartition("@")[0].split("+", 1)[0].lower()


class SinkHandler:
    def __init__(self, state: SinkState, sink: str, *, pipelining: bool = True) -> None:
        self.state = state
        self.sink = sink
        self.pipelining = pipelining

    async def handle_EHLO(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]:
        session.host_name = hostname
        if self.pipelining:
            # aiosmtpd reads pipelined commands one by one anyway; this lets clients know.
            responses.insert(-1, "250-PIPELINING")
        return responses

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if self.state.throttle_above and self._throttled():
            return "421 4.7.0 Try again later, closing connection"
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        if not getattr(session, "in_transaction", False):
            session.in_transaction = True  # type: ignore[attr-defined]
            self.state.in_flight += 1
            self.state.max_in_flight = max(self.state.max_in_flight, self.state.in_flight)
        return "250 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        state = self.state
        state.rcpt_commands[address] += 1
        state._note()
        kind = behaviour(address)
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "tempfail":
            state.seen[address] += 1
            if state.seen[address] == 1:
                return "451 4.7.1 try again later"
        if kind == "blocked":
            state.seen[address] += 1
            if state.seen[address] == 1:
                return "550 5.7.1 Messages weren't sent: part of your network is on our block list (S3150)"
        if kind == "slow-down":
            state.seen[address] += 1
            if state.seen[address] == 1:
                return (
                    f"421 4.7.0 Too much mail from you, try again in {state.stated_delay} seconds"
                )
        if kind == "reject-rcpt":
            return "550 5.1.1 no such user here"
        if kind == "full":
            return "552 5.2.2 mailbox full"
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(options)
        return "250 OK"

    async def handle_RSET(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self._end(session)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        state = self.state
        kinds = {behaviour(a) for a in envelope.rcpt_tos}
        received = ReceivedMessage(
            sink=self.sink,
            mail_from=envelope.mail_from or "",
            rcpt_tos=list(envelope.rcpt_tos),
            data=bytes(envelope.original_content or b""),
            tls=session.ssl is not None,
            auth_user=_auth_user(session),
            replied=True,
            helo=session.host_name,
        )
        if "drop-after-dot" in kinds and self._first("drop-after-dot", envelope):
            received.replied = False
            state.messages.append(received)
            self._end(session)
            state._note()
            assert server.transport is not None
            server.transport.abort()
            await asyncio.sleep(3600)  # cancelled by the connection loss
        if "hang-data" in kinds and self._first("hang-data", envelope):
            received.replied = False
            state.messages.append(received)
            self._end(session)
            state._note()
            await asyncio.sleep(3600)  # cancelled when the client gives up and hangs up
        if "slow" in kinds:
            await asyncio.sleep(state.slow_seconds)
        if "held" in kinds:
            await state.release.wait()
        self._end(session)
        if "reject-data" in kinds:
            state._note()
            return "554 5.6.0 message content rejected"
        state.messages.append(received)
        state._note()
        received.replied_at = time.time()
        return "250 2.0.0 OK queued"

    def _throttled(self) -> bool:
        state, now = self.state, time.monotonic()
        while state.mail_times and state.mail_times[0] < now - 1.0:
            state.mail_times.popleft()
        if len(state.mail_times) >= state.throttle_above:
            state.throttled.append(now)
            return True
        state.mail_times.append(now)
        return False

    def _first(self, kind: str, envelope: Envelope) -> bool:
        key = f"{kind}:" + ",".join(a for a in envelope.rcpt_tos if behaviour(a) == kind)
        self.state.seen[key] += 1
        return self.state.seen[key] == 1

    def _end(self, session: Session) -> None:
        if getattr(session, "in_transaction", False):
            session.in_transaction = False  # type: ignore[attr-defined]
            self.state.in_flight -= 1


def _auth_user(session: Session) -> str | None:
    if not session.authenticated:
        return None
    login = session.auth_data
    return login.decode() if isinstance(login, bytes) else str(login)


class SinkSMTP(SMTP):  # type: ignore[misc]
    """aiosmtpd's SMTP with the cuts and refusals the behaviours above need."""

    def __init__(
        self, handler: SinkHandler, *, broken_starttls: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(handler, **kwargs)
        self.sink_handler = handler
        self.broken_starttls = broken_starttls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._original_transport is None:  # not the second call made by STARTTLS
            state = self.sink_handler.state
            state.connections[self.sink_handler.sink] += 1
            state.sessions += 1
            state.max_sessions = max(state.max_sessions, state.sessions)
            self.session_open = True
            state._note()
        super().connection_made(transport)

    def _session_over(self) -> None:
        if getattr(self, "session_open", False):
            self.session_open = False
            self.sink_handler.state.sessions -= 1

    async def smtp_QUIT(self, arg: str) -> None:
        self._session_over()
        await super().smtp_QUIT(arg)

    def connection_lost(self, error: Exception | None) -> None:
        self._session_over()
        if self.session is not None:
            self.sink_handler._end(self.session)
        super().connection_lost(error)

    async def smtp_STARTTLS(self, arg: str) -> None:
        if self.broken_starttls:
            await self.push("220 Ready to start TLS")
            assert self.transport is not None
            self.transport.write(b"this is not a TLS handshake\r\n" * 4)
            self.transport.close()
            return
        await super().smtp_STARTTLS(arg)

    async def smtp_DATA(self, arg: str) -> None:
        envelope = self.envelope
        if envelope is not None and any(behaviour(a) == "drop-mid-data" for a in envelope.rcpt_tos):
            if self.sink_handler._first("drop-mid-data", envelope):
                await self.push("354 End data with <CR><LF>.<CR><LF>")
                await self._reader.readuntil(b"\r\n")
                assert self.transport is not None
                self.transport.abort()
                return
        await super().smtp_DATA(arg)


class _RefusingGreeting(asyncio.Protocol):
    def __init__(self, state: SinkState, sink: str, greeting: str) -> None:
        self.state, self.sink, self.greeting = state, sink, greeting

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.state.connections[self.sink] += 1
        self.state._note()
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.greeting.encode() + b"\r\n")
        transport.close()


def authenticator(users: dict[str, str], state: SinkState, sink: str) -> Any:
    def check(
        server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any
    ) -> AuthResult:
        if isinstance(data, LoginPassword):
            login, password = data.login.decode(), data.password.decode()
            state.auth_attempts.append((sink, login, password))
            if users.get(login) == password:
                return AuthResult(success=True, auth_data=login)
        return AuthResult(success=False, handled=False)

    return check


async def start_sink(
    state: SinkState,
    host: str,
    port: int = 0,
    *,
    tls_context: ssl.SSLContext | None = None,
    broken_starttls: bool = False,
    greeting: str | None = None,
    users: dict[str, str] | None = None,
    pipelining: bool = True,
) -> asyncio.Server:
    """One sink listening on host:port (port 0: any); `pipelining` offers PIPELINING."""
    loop = asyncio.get_running_loop()
    if greeting is not None:
        return await loop.create_server(
            lambda: _RefusingGreeting(state, host, greeting), host, port
        )
    if broken_starttls and tls_context is None:
        # aiosmtpd offers STARTTLS only with a context; this one is never used.
        tls_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    handler = SinkHandler(state, host, pipelining=pipelining)
    extra: dict[str, Any] = {}
    if users is not None:
        extra = {"authenticator": authenticator(users, state, host), "auth_require_tls": True}

    def factory() -> SinkSMTP:
        return SinkSMTP(
            handler,
            broken_starttls=broken_starttls,
            hostname=f"sink-{host}",
            tls_context=tls_context,
            require_starttls=False,
            enable_SMTPUTF8=True,
            data_size_limit=None,
            **extra,
        )

    return await loop.create_server(factory, host, port)


async def start_sinks(
    state: SinkState, specs: dict[str, dict[str, Any]]
) -> tuple[int, list[asyncio.Server]]:
    """Sinks on several loopback addresses sharing one port (MX hosts all listen on port 25).
    `specs` maps each address to start_sink's keyword arguments."""
    for _ in range(20):
        servers: list[asyncio.Server] = []
        hosts = list(specs)
        try:
            first = await start_sink(state, hosts[0], 0, **specs[hosts[0]])
            servers.append(first)
            port = first.sockets[0].getsockname()[1]
            for host in hosts[1:]:
                servers.append(await start_sink(state, host, port, **specs[host]))
        except OSError:
            await stop_servers(servers)
            continue
        return port, servers
    raise RuntimeError("could not find one free port on every sink address")


async def stop_servers(servers: list[asyncio.Server]) -> None:
    for server in servers:
        server.close()
    for server in servers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
