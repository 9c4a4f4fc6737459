"""A small mail world on loopback for outbound tests: DNS zones, MX sinks, a test CA.

engine --DNS--> DnsServer 127.0.0.1:<p1>
       --SMTP-> sinks on 127.0.0.2..7:<p2> (one port, as MX hosts all listen on 25)

127.0.0.2  plain sink               mx1.order.test, ok.busy.test, mx.plain.test
127.0.0.3  plain sink               mx2.order.test, live.fallback.test, implicit.test
127.0.0.4  greets "421 busy"        busy.busy.test
127.0.0.5  STARTTLS (mx.tls.test)   mx.tls.test, mx.wrongname.test
127.0.0.6  STARTTLS that breaks     mx.badtls.test
127.0.0.7  STARTTLS + AUTH          relay.test (a smarthost)
127.0.0.9  nothing listens          dead.fallback.test (connection refused)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pigeon_mta.config import (
    DatabaseSettings,
    DeliverySettings,
    DnsSettings,
    Duration,
    ServerSettings,
    Settings,
)
from tests.peers.dns_server import DnsServer
from tests.peers.smtp_sink import SinkState, start_sinks, stop_servers
from tests.peers.tls import TestCA, make_ca

RELAY_USER = ("relay-user", "relay-secret")


@dataclass
class World:
    dns: DnsServer
    sinks: SinkState
    port: int
    ca: TestCA
    servers: list[asyncio.Server]

    def settings(self, db_url: str = "", **delivery: Any) -> Settings:
        """Settings that point the engine at this world, with quick timers for tests."""
        base = DeliverySettings(
            port=self.port,
            retry_initial=Duration(1),
            retry_max=Duration(2),
            lease=Duration(30),
            poll_interval=Duration(0.1),
            concurrency=20,
            connect_timeout=Duration(5),
            command_timeout=Duration(5),
            data_timeout=Duration(5),
            idle_timeout=Duration(10),
            tls_ca_file=str(self.ca.ca_file),
        )
        return Settings(
            server=ServerSettings(hostname="pigeon.test", node_name="engine-test"),
            database=DatabaseSettings(url=db_url),
            listener=(),
            delivery=dataclasses.replace(base, **delivery),
            dns=DnsSettings(nameservers=(self.dns.nameserver,), timeout=Duration(2)),
        )


def _zones(dns: DnsServer) -> None:
    dns.mx("order.test", (10, "mx1.order.test"), (20, "mx2.order.test"))
    dns.a("mx1.order.test", "127.0.0.2")
    dns.a("mx2.order.test", "127.0.0.3")
    dns.mx("fallback.test", (10, "dead.fallback.test"), (20, "live.fallback.test"))
    dns.a("dead.fallback.test", "127.0.0.9")
    dns.a("live.fallback.test", "127.0.0.3")
    dns.mx("busy.test", (10, "busy.busy.test"), (20, "ok.busy.test"))
    dns.a("busy.busy.test", "127.0.0.4")
    dns.a("ok.busy.test", "127.0.0.2")
    dns.a("implicit.test", "127.0.0.3")
    dns.null_mx("nullmx.test")
    dns.fail("servfail.test")
    dns.mx("xn--bcher-kva.test", (10, "mx1.order.test"))  # bücher.test
    dns.mx("plain.test", (10, "mx.plain.test"))
    dns.a("mx.plain.test", "127.0.0.2")
    dns.mx("tls.test", (10, "mx.tls.test"))
    dns.a("mx.tls.test", "127.0.0.5")
    dns.mx("wrongname.test", (10, "mx.wrongname.test"))
    dns.a("mx.wrongname.test", "127.0.0.5")
    dns.mx("badtls.test", (10, "mx.badtls.test"))
    dns.a("mx.badtls.test", "127.0.0.6")
    dns.a("relay.test", "127.0.0.7")


@asynccontextmanager
async def mail_world(tmp_path: Path, *, pipelining: bool = True) -> AsyncIterator[World]:
    """`pipelining`: whether the sinks offer PIPELINING (RFC 2920)."""
    dns = await DnsServer().start()
    _zones(dns)
    ca = make_ca(tmp_path)
    state = SinkState(slow_seconds=1.0)
    port, servers = await start_sinks(
        state,
        {
            "127.0.0.2": {"pipelining": pipelining},
            "127.0.0.3": {"pipelining": pipelining},
            "127.0.0.4": {"greeting": "421 4.3.2 busy, try later"},
            "127.0.0.5": {
                "tls_context": ca.server_context("mx.tls.test"),
                "pipelining": pipelining,
            },
            "127.0.0.6": {"broken_starttls": True, "pipelining": pipelining},
            "127.0.0.7": {
                "tls_context": ca.server_context("relay.test"),
                "users": dict([RELAY_USER]),
                "pipelining": pipelining,
            },
        },
    )
    try:
        yield World(dns, state, port, ca, servers)
    finally:
        await stop_servers(servers)
        await dns.close()
