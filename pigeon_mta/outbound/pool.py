"""Outbound SMTP connections: opening one (greeting, EHLO, STARTTLS, AUTH) and pooling them.

Connections are keyed by (MX host, IP, port, TLS mode, AUTH user) and reused across messages, with
a RSET before each reuse to prove the connection still works. Each key has a ceiling on open
connections; each connection a ceiling on messages; idle ones are closed after a while. Finding a
working connection for a route walks its hosts and their addresses in order and moves on when a
connection is refused, times out, or is greeted with anything but 220.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import ssl
import time
import warnings
from dataclasses import dataclass, field

import aiosmtplib

from pigeon_mta.config import DeliverySettings, TlsPolicy
from pigeon_mta.metrics import OUTBOUND_CONNECTION_REUSES, OUTBOUND_CONNECTIONS_OPEN
from pigeon_mta.model import Reply
from pigeon_mta.outbound.classify import Stage, parse_reply
from pigeon_mta.outbound.mx import Route, RouteFailure, Router
from pigeon_mta.outbound.wire import Wire

log = logging.getLogger(__name__)

# Addresses tried for one delivery, across all MX hosts, before giving up for this attempt.
MAX_ADDRESSES_TRIED = 10
# After an opportunistic STARTTLS handshake failed with a host, go straight to plaintext for a
# while instead of paying a failed handshake and a second connection for every message.
TLS_BROKEN_MEMORY = 600.0
# A connection idle longer than this is probed with RSET before it carries another message. One
# used just now needs no probe: the reply to its final dot already reset the SMTP state
# (RFC 5321 4.1.1.4), and should it have died meanwhile, the engine retries on a fresh connection.
PROBE_AFTER_IDLE = 2.0
# How long a polite QUIT may take before the connection is simply closed.
QUIT_TIMEOUT = 5.0


@dataclass(frozen=True)
class PoolKey:
    host: str  # the MX host name: TLS server name, and what the attempt log shows
    ip: str
    port: int
    tls: TlsPolicy  # the mode this connection was opened with ("none" for a plaintext fallback)
    username: str = ""  # connections authenticated as different users are not interchangeable


@dataclass(frozen=True)
class ConnectOptions:
    ehlo_name: str
    connect_timeout: float
    command_timeout: float
    tls_ca_file: str = ""

    @classmethod
    def from_settings(cls, ehlo_name: str, delivery: DeliverySettings) -> ConnectOptions:
        return cls(
            ehlo_name=ehlo_name,
            connect_timeout=delivery.connect_timeout,
            command_timeout=delivery.command_timeout,
            tls_ca_file=delivery.tls_ca_file,
        )


class ConnectFailed(Exception):
    """Opening a connection failed at `stage`; `result` is the reply or error that said so."""

    def __init__(
        self, stage: Stage, result: Reply | BaseException, *, tls_handshake: bool = False
    ) -> None:
        super().__init__(str(result))
        self.stage: Stage = stage
        self.result = result
        self.tls_handshake = tls_handshake


class SmtpConnection:
    """One open client connection; `transactions` counts messages sent over it."""

    def __init__(self, key: PoolKey, client: aiosmtplib.SMTP) -> None:
        self.key = key
        self.client = client
        self.transactions = 0
        self.idle_since = time.monotonic()
        self.tls_version: str | None = None
        self.tls_cipher: str | None = None
        # Set once the connection is set up: what the mail transactions run on (see wire.py).
        self.wire: Wire | None = None
        self._closed = False
        OUTBOUND_CONNECTIONS_OPEN.inc()

    def take_over(self) -> Wire:
        """Hand the set-up connection from aiosmtplib to a Wire (which can pipeline)."""
        protocol = self.client.protocol
        transport = protocol.transport if protocol is not None else None
        if transport is None or protocol is None:
            raise aiosmtplib.SMTPServerDisconnected("the connection was lost during its set-up")
        self.wire = Wire(transport, protocol)
        return self.wire

    @property
    def usable(self) -> bool:
        return not self._closed and self.wire is not None and self.wire.connected

    def supports(self, extension: str) -> bool:
        return self.client.supports_extension(extension)

    def extension_value(self, extension: str) -> str:
        return self.client.esmtp_extensions.get(extension.lower(), "")

    def note_tls(self) -> None:
        ssl_object = self.client.get_transport_info("ssl_object")
        if ssl_object is not None:
            self.tls_version = ssl_object.version()
            cipher = ssl_object.cipher()
            self.tls_cipher = cipher[0] if cipher else None

    async def reset(self, timeout: float) -> bool:
        """RSET; True when the server answered 250 (the connection is fit for a new transaction)."""
        if self.wire is None:
            return False
        try:
            response = await self.wire.command(b"RSET", timeout)
        except (aiosmtplib.SMTPException, OSError, TimeoutError):
            return False
        return response.code == 250

    def abort(self) -> None:
        """Close at once, without QUIT (after an error, or when shutting down)."""
        if not self._closed:
            self._closed = True
            OUTBOUND_CONNECTIONS_OPEN.dec()
        self.client.close()

    async def quit(self, timeout: float = 5.0) -> None:
        """Polite close: QUIT, then close whatever the server says."""
        if self.usable and self.wire is not None:
            with contextlib.suppress(aiosmtplib.SMTPException, OSError, TimeoutError):
                await self.wire.command(b"QUIT", timeout)
        self.abort()


# Opportunistic TLS takes any cipher OpenSSL still has, at security level 0: a server that speaks
# only TLS 1.0 or 1.1 (with their SHA-1 CBC suites, which Python's default list and OpenSSL 3's
# default level refuse) gets TLS rather than plaintext, as Postfix's `may` gives it. Anonymous and
# null ciphers stay out. The server still chooses, and modern servers choose as before.
OPPORTUNISTIC_CIPHERS = "DEFAULT:!aNULL:!eNULL:@SECLEVEL=0"


def tls_context(policy: TlsPolicy, ca_file: str = "") -> ssl.SSLContext:
    """The client context for a policy: `verify` checks the chain and the name; the others take
    any certificate (opportunistic TLS protects against passive listeners only, RFC 7435).
    `verify` and `required` need TLS 1.2 or later; `opportunistic` takes TLS 1.0 and later, since
    the other choice is plaintext."""
    if policy == "verify":
        return ssl.create_default_context(cafile=ca_file or None)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if policy == "opportunistic":
        context.set_ciphers(OPPORTUNISTIC_CIPHERS)
        with warnings.catch_warnings():
            # Python warns that TLS 1.0 is deprecated; here it is on purpose (above).
            warnings.simplefilter("ignore", DeprecationWarning)
            context.minimum_version = ssl.TLSVersion.TLSv1
    return context


async def open_connection(
    key: PoolKey, options: ConnectOptions, password: str = ""
) -> SmtpConnection:
    """Connect, read the greeting, EHLO, STARTTLS per `key.tls`, AUTH when a user is set."""
    client = aiosmtplib.SMTP(
        hostname=key.ip,
        port=key.port,
        local_hostname=options.ehlo_name,
        timeout=options.command_timeout,
        start_tls=False,
    )
    try:
        await client.connect(timeout=options.connect_timeout)
    except aiosmtplib.SMTPConnectResponseError as exc:
        raise ConnectFailed("connect", parse_reply(exc.code, exc.message)) from None
    except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
        raise ConnectFailed("connect", exc) from None
    conn = SmtpConnection(key, client)
    try:
        _set_nodelay(client)
        await _hello(client)
        if key.tls != "none":
            await _starttls(conn, options)
        if key.username:
            await _login(client, key.username, password)
        conn.take_over()
    except aiosmtplib.SMTPServerDisconnected as exc:
        conn.abort()
        raise ConnectFailed("connect", exc) from None
    except BaseException:
        conn.abort()
        raise
    return conn


def _set_nodelay(client: aiosmtplib.SMTP) -> None:
    # Several small writes before a read would otherwise wait on Nagle + delayed ACK.
    sock = client.get_transport_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _hello(client: aiosmtplib.SMTP) -> None:
    try:
        try:
            await client.ehlo()
        except aiosmtplib.SMTPHeloError:
            if not client.is_connected:
                raise
            await client.helo()
    except aiosmtplib.SMTPResponseException as exc:
        raise ConnectFailed("connect", parse_reply(exc.code, exc.message)) from None
    except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
        raise ConnectFailed("connect", exc) from None


async def _starttls(conn: SmtpConnection, options: ConnectOptions) -> None:
    key, client = conn.key, conn.client
    if not client.supports_extension("starttls"):
        if key.tls == "opportunistic":
            return
        raise ConnectFailed(
            "connect",
            Reply(0, "4.7.4", f"TLS is {key.tls} for {key.host} but it does not offer STARTTLS"),
        )
    try:
        await client.starttls(
            server_hostname=key.host, tls_context=tls_context(key.tls, options.tls_ca_file)
        )
    except aiosmtplib.SMTPResponseException as exc:
        # Refused STARTTLS: treated like a failed handshake (no plaintext on this connection).
        raise ConnectFailed(
            "connect", parse_reply(exc.code, exc.message), tls_handshake=True
        ) from None
    except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
        # ssl.SSLError is an OSError: a certificate that does not verify lands here.
        raise ConnectFailed("connect", exc, tls_handshake=True) from None
    conn.note_tls()
    await _hello(client)  # RFC 3207 4.2: forget what was learnt before TLS, ask again


async def _login(client: aiosmtplib.SMTP, username: str, password: str) -> None:
    try:
        await client.login(username, password)
    except aiosmtplib.SMTPResponseException as exc:
        raise ConnectFailed("auth", parse_reply(exc.code, exc.message)) from None
    except aiosmtplib.SMTPException as exc:
        if not client.is_connected:
            raise ConnectFailed("auth", ConnectionError(str(exc))) from None
        raise ConnectFailed("auth", Reply(0, "4.7.0", f"AUTH not possible: {exc}")) from None
    except (OSError, TimeoutError) as exc:
        raise ConnectFailed("auth", exc) from None


# ---------------------------------------------------------------- the pool


@dataclass
class _Slot:
    """The connections of one key: idle ones (most recent last) and how many are open."""

    idle: collections.deque[SmtpConnection] = field(default_factory=collections.deque)
    open: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


@dataclass(frozen=True)
class Connected:
    connection: SmtpConnection
    reused: bool


@dataclass(frozen=True)
class NotConnected:
    """No host of the route took a connection; the last failure says why."""

    stage: Stage
    result: Reply | BaseException
    host: str | None = None
    ip: str | None = None
    port: int | None = None


class ConnectionPool:
    def __init__(
        self,
        options: ConnectOptions,
        *,
        max_per_host: int,
        idle_timeout: float,
    ) -> None:
        self.options = options
        self.max_per_host = max_per_host
        self.idle_timeout = idle_timeout
        self._slots: dict[PoolKey, _Slot] = {}
        self._tls_broken: dict[tuple[str, str, int], float] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False
        self._busy: set[SmtpConnection] = set()
        self._quitting: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ walking a route

    async def connect(
        self, route: Route, tls: TlsPolicy, router: Router
    ) -> Connected | NotConnected:
        """A working connection to the first host of `route` that takes one."""
        last = NotConnected("connect", Reply(0, "4.4.1", "no host to connect to"))
        tried = 0
        for hop in route.hops:
            addresses = await router.addresses(hop.host)
            if isinstance(addresses, RouteFailure):
                last = NotConnected("route", addresses.reply, hop.host, None, hop.port)
                continue
            for ip in addresses:
                if tried >= MAX_ADDRESSES_TRIED:
                    return last
                tried += 1
                key = PoolKey(
                    hop.host,
                    ip,
                    hop.port,
                    self._effective_tls(hop.host, ip, hop.port, tls),
                    route.username,
                )
                try:
                    return await self.acquire(key, route.password)
                except ConnectFailed as failure:
                    last = NotConnected(failure.stage, failure.result, hop.host, ip, hop.port)
                    if failure.tls_handshake and key.tls == "opportunistic":
                        # Never plaintext on the connection whose handshake failed: a new one.
                        self._tls_broken[(hop.host, ip, hop.port)] = (
                            time.monotonic() + TLS_BROKEN_MEMORY
                        )
                        log.info(
                            "STARTTLS with %s [%s] failed (%s); retrying without TLS",
                            hop.host,
                            ip,
                            failure.result,
                        )
                        plain = PoolKey(hop.host, ip, hop.port, "none", route.username)
                        try:
                            return await self.acquire(plain, route.password)
                        except ConnectFailed as again:
                            last = NotConnected(again.stage, again.result, hop.host, ip, hop.port)
                    elif failure.stage == "auth":
                        # The relayhost refused our credentials: other addresses would too.
                        return last
        return last

    def _effective_tls(self, host: str, ip: str, port: int, tls: TlsPolicy) -> TlsPolicy:
        if tls != "opportunistic":
            return tls
        until = self._tls_broken.get((host, ip, port))
        if until is None:
            return tls
        if until < time.monotonic():
            del self._tls_broken[(host, ip, port)]
            return tls
        return "none"

    # ------------------------------------------------------------ acquire / release

    async def acquire(self, key: PoolKey, password: str = "") -> Connected:
        """An idle connection for `key` (proved alive by RSET), else a new one within the limit."""
        self._start_reaper()
        slot = self._slots.setdefault(key, _Slot())
        while True:
            while slot.idle:
                conn = slot.idle.pop()
                if self._expired(conn) or not conn.usable or not await self._probe(conn):
                    self._discard(slot, conn)
                    continue
                OUTBOUND_CONNECTION_REUSES.inc()
                self._busy.add(conn)
                return Connected(conn, reused=True)
            if slot.open < self.max_per_host:
                slot.open += 1
                try:
                    conn = await open_connection(key, self.options, password)
                except BaseException:
                    slot.open -= 1
                    await self._notify(slot)
                    raise
                self._busy.add(conn)
                return Connected(conn, reused=False)
            async with slot.changed:
                await slot.changed.wait()

    async def release(self, conn: SmtpConnection, *, reusable: bool, max_messages: int) -> None:
        """Give a connection back: kept idle for the next message, or closed."""
        self._busy.discard(conn)
        slot = self._slots.setdefault(conn.key, _Slot())
        if reusable and conn.usable and conn.transactions < max_messages and not self._closing:
            conn.idle_since = time.monotonic()
            slot.idle.append(conn)
        elif conn.usable and reusable:
            # Said goodbye in the background: a peer slow to answer QUIT holds up nothing.
            slot.open -= 1
            self._spawn_quit(conn)
        else:
            slot.open -= 1
            conn.abort()
        await self._notify(slot)

    def _spawn_quit(self, conn: SmtpConnection) -> None:
        task = asyncio.create_task(conn.quit(QUIT_TIMEOUT), name="smtp-quit")
        self._quitting.add(task)
        task.add_done_callback(self._quitting.discard)

    async def _probe(self, conn: SmtpConnection) -> bool:
        if time.monotonic() - conn.idle_since < PROBE_AFTER_IDLE:
            return True
        return await conn.reset(self.options.command_timeout)

    def _discard(self, slot: _Slot, conn: SmtpConnection) -> None:
        slot.open -= 1
        conn.abort()

    def _expired(self, conn: SmtpConnection) -> bool:
        return time.monotonic() - conn.idle_since > self.idle_timeout

    @staticmethod
    async def _notify(slot: _Slot) -> None:
        async with slot.changed:
            slot.changed.notify()

    def abort_busy(self) -> None:
        """Break every connection in use (shutdown past its deadline)."""
        for conn in list(self._busy):
            conn.abort()

    # ------------------------------------------------------------ housekeeping

    def _start_reaper(self) -> None:
        if self._reaper is None and not self._closing:
            self._reaper = asyncio.create_task(self._reap(), name="smtp-pool-reaper")

    async def _reap(self) -> None:
        interval = max(0.5, min(self.idle_timeout / 2, 5.0))
        while True:
            await asyncio.sleep(interval)
            for slot in self._slots.values():
                stale = [c for c in slot.idle if self._expired(c) or not c.usable]
                for conn in stale:
                    slot.idle.remove(conn)
                    slot.open -= 1
                    self._spawn_quit(conn)
            # Forget hosts with nothing open, and expired memories of broken TLS.
            for key in [k for k, slot in self._slots.items() if slot.open == 0]:
                del self._slots[key]
            now = time.monotonic()
            for host in [h for h, until in self._tls_broken.items() if until < now]:
                del self._tls_broken[host]

    @property
    def open_connections(self) -> int:
        return sum(slot.open for slot in self._slots.values())

    async def close(self) -> None:
        """QUIT every idle connection; connections still in use are closed when released."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        idle = [c for slot in self._slots.values() for c in slot.idle]
        for slot in self._slots.values():
            slot.open -= len(slot.idle)
            slot.idle.clear()
        await asyncio.gather(*(c.quit(2.0) for c in idle), *self._quitting, return_exceptions=True)
