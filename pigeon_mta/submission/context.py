"""State shared by the connections of a listener, and the facts kept about one connection."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg

from pigeon_mta.config import LimitsSettings, ListenerSettings, Settings
from pigeon_mta.intake.accept import Intake
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.submission.auth import Authenticator
from pigeon_mta.submission.tls import ListenerTLS

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class Conversation:
    """What we know about one client connection."""

    client_ip: str
    trusted: bool  # from relay.trusted_networks, on a relay listener
    helo: str | None = None
    esmtp: bool = False
    tls_version: str | None = None
    tls_cipher: str | None = None
    login: store_credentials.Login | None = None
    # The org's answers to "may it send as this domain?", asked once per connection.
    sender_domains: dict[str, bool] = field(default_factory=dict)


def conversation(server: Any) -> Conversation:
    """The Conversation of the connection an aiosmtpd hook is given as `server`."""
    conv = server.conversation
    assert isinstance(conv, Conversation)
    return conv


class OpenSession(Protocol):
    """What a listener's shutdown needs of one of its open connections (protocol.SMTPSession,
    which imports this module: the listener's state does not import the protocol)."""

    enqueuing: int  # commits under way; shutdown waits for them

    def close_with(self, reply: str) -> None: ...


class ConnectionCounter:
    """Open connections per client IP in this process (all listeners together)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def acquire(self, ip: str) -> bool:
        count = self._open.get(ip, 0)
        if self.limit and count >= self.limit:
            return False
        self._open[ip] = count + 1
        return True

    def open_from(self, ip: str) -> int:
        return self._open.get(ip, 0)

    def release(self, ip: str) -> None:
        count = self._open.get(ip, 0) - 1
        if count > 0:
            self._open[ip] = count
        else:
            self._open.pop(ip, None)


@dataclass
class ListenerContext:
    settings: Settings
    listener: ListenerSettings
    pool: asyncpg.Pool
    tls: ListenerTLS
    authenticator: Authenticator
    connections: ConnectionCounter
    trusted_networks: tuple[IPNetwork, ...]
    intake: Intake  # the process's one way into the queue (intake/accept.py)
    sessions: set[OpenSession] = field(default_factory=set)
    shutting_down: bool = False

    @property
    def name(self) -> str:
        return self.listener.name

    @property
    def mode(self) -> str:
        return self.listener.mode

    @property
    def hostname(self) -> str:
        return self.settings.server.hostname

    @property
    def limits(self) -> LimitsSettings:
        return self.settings.limits

    @property
    def plaintext_auth(self) -> bool:
        """AUTH without TLS: only when configured, and only on a loopback address."""
        if not self.listener.allow_plaintext_auth:
            return False
        try:
            return ipaddress.ip_address(self.listener.address.host).is_loopback
        except ValueError:
            return self.listener.address.host == "localhost"
