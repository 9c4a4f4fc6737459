"""Opening one outbound SMTP connection: greeting, EHLO, STARTTLS, AUTH, and STARTTLS fallbacks.

`TlsFallbacks` remembers the addresses whose opportunistic STARTTLS failed, so that they get
plaintext at once for a while. aiosmtplib runs the set-up; then the connection's transport goes to
a `Wire` (wire.py), which carries the mail transactions. A connection that cannot be opened raises
`ConnectFailed` with the stage and the reply or error that said so, for `classify` to judge.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
import warnings
from dataclasses import dataclass

import aiosmtplib

from pigeon_mta.config import DeliverySettings, TlsPolicy
from pigeon_mta.metrics import OUTBOUND_CONNECTIONS_OPEN
from pigeon_mta.model import Reply
from pigeon_mta.outbound.classify import Stage, parse_reply
from pigeon_mta.outbound.wire import Wire

# After an opportunistic STARTTLS handshake failed with a host, go straight to plaintext for a
# while instead of paying a failed handshake and a second connection for every message.
TLS_BROKEN_MEMORY = 600.0


@dataclass(frozen=True)
class ConnectionKey:
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

    def __init__(self, key: ConnectionKey, client: aiosmtplib.SMTP) -> None:
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
# null ciphers stay out. The server chooses among what both offer, so a modern server still picks
# TLS 1.3 or a strong TLS 1.2 suite.
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
    key: ConnectionKey, options: ConnectOptions, password: str = ""
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


class TlsFallbacks:
    """The (host, IP, port) whose opportunistic STARTTLS failed, each until when it gets
    plaintext instead. Never plaintext on the connection whose handshake failed: the caller opens
    a new one."""

    def __init__(self, memory: float = TLS_BROKEN_MEMORY) -> None:
        self.memory = memory
        self._until: dict[tuple[str, str, int], float] = {}

    def policy(self, host: str, ip: str, port: int, tls: TlsPolicy) -> TlsPolicy:
        """The mode to open a connection to this address with: `tls`, or "none" while its failed
        handshake is remembered."""
        if tls != "opportunistic":
            return tls
        until = self._until.get((host, ip, port))
        if until is None:
            return tls
        if until < time.monotonic():
            del self._until[(host, ip, port)]
            return tls
        return "none"

    def remember(self, host: str, ip: str, port: int) -> None:
        self._until[(host, ip, port)] = time.monotonic() + self.memory

    def forget_expired(self) -> None:
        now = time.monotonic()
        for address in [a for a, until in self._until.items() if until < now]:
            del self._until[address]
