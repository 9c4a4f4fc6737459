"""Pooled outbound SMTP connections: reuse per key, ceilings, idle reaping, the walk of a route.

Connections are keyed by (MX host, IP, port, TLS mode, AUTH user) and reused across messages, with
a RSET before each reuse to prove the connection still works. Each key has a ceiling on open
connections; each connection a ceiling on messages; idle ones are closed after a while. Finding a
working connection for a route walks its hosts and their addresses in order and moves on when a
connection is refused, times out, or is greeted with anything but 220. Opening one is connect.py's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pigeon_mta.config import TlsPolicy
from pigeon_mta.metrics import OUTBOUND_CONNECTION_REUSES
from pigeon_mta.model import Reply
from pigeon_mta.outbound.classify import Stage
from pigeon_mta.outbound.connect import (
    ConnectFailed,
    ConnectionKey,
    ConnectOptions,
    SmtpConnection,
    TlsFallbacks,
    open_connection,
)
from pigeon_mta.outbound.mx import Route, RouteFailure, Router

log = logging.getLogger(__name__)

# Addresses tried for one delivery, across all MX hosts, before giving up for this attempt.
MAX_ADDRESSES_TRIED = 10
# A connection idle longer than this is probed with RSET before it carries another message. One
# used just now needs no probe: the reply to its final dot already reset the SMTP state
# (RFC 5321 4.1.1.4), and should it have died meanwhile, the engine retries on a fresh connection.
PROBE_AFTER_IDLE = 2.0
# How long a polite QUIT may take before the connection is simply closed.
QUIT_TIMEOUT = 5.0


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
        self._slots: dict[ConnectionKey, _Slot] = {}
        self._tls_fallbacks = TlsFallbacks()
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
                key = ConnectionKey(
                    hop.host,
                    ip,
                    hop.port,
                    self._tls_fallbacks.policy(hop.host, ip, hop.port, tls),
                    route.username,
                )
                try:
                    return await self.acquire(key, route.password)
                except ConnectFailed as failure:
                    last = NotConnected(failure.stage, failure.result, hop.host, ip, hop.port)
                    if failure.tls_handshake and key.tls == "opportunistic":
                        # Never plaintext on the connection whose handshake failed: a new one.
                        self._tls_fallbacks.remember(hop.host, ip, hop.port)
                        log.info(
                            "STARTTLS with %s [%s] failed (%s); retrying without TLS",
                            hop.host,
                            ip,
                            failure.result,
                        )
                        plain = ConnectionKey(hop.host, ip, hop.port, "none", route.username)
                        try:
                            return await self.acquire(plain, route.password)
                        except ConnectFailed as again:
                            last = NotConnected(again.stage, again.result, hop.host, ip, hop.port)
                    elif failure.stage == "auth":
                        # The relayhost refused our credentials: other addresses would too.
                        return last
        return last

    # ------------------------------------------------------------ acquire / release

    async def acquire(self, key: ConnectionKey, password: str = "") -> Connected:
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

    async def close_idle(self, keys: Iterable[ConnectionKey], *, keep: int) -> None:
        """QUIT the idle connections of `keys` beyond the `keep` most recently used, and wait for
        them: a destination's session budget counts its pooled connections, so the session must
        be over before its slot is given back."""
        idle = sorted(
            (
                (conn.idle_since, slot, conn)
                for key in keys
                if (slot := self._slots.get(key)) is not None
                for conn in slot.idle
            ),
            key=lambda item: item[0],
            reverse=True,
        )
        closing = idle[max(0, keep) :]
        for _, slot, conn in closing:
            slot.idle.remove(conn)
            slot.open -= 1
        if closing:
            await asyncio.gather(
                *(conn.quit(QUIT_TIMEOUT) for _, _, conn in closing), return_exceptions=True
            )
            for _, slot, _ in closing:
                await self._notify(slot)

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
            self._tls_fallbacks.forget_expired()

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
