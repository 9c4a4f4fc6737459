"""A small authoritative DNS server for test zones, on loopback, UDP and TCP on one ephemeral port.

    resolver under test --UDP/TCP--> DnsServer (127.0.0.1:<port>) -- answers from `records`

Names can also be made to fail (SERVFAIL) or to never answer (a timeout). Every query is counted,
so a test can see what was asked and what a cache saved.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct
import typing

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

SOA_NAME = dns.name.from_text("test.")
SOA_TEXT = "ns.test. hostmaster.test. 1 3600 600 86400 60"


class DnsServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.records: dict[
            tuple[dns.name.Name, dns.rdatatype.RdataType], tuple[int, list[str]]
        ] = {}
        self.servfail: set[dns.name.Name] = set()
        self.silent: set[dns.name.Name] = set()
        self.queries: collections.Counter[tuple[str, str]] = collections.Counter()
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    # ------------------------------------------------------------ zone data

    def add(self, name: str, rdtype: str, *values: str, ttl: int = 300) -> None:
        key = (dns.name.from_text(name), dns.rdatatype.from_text(rdtype))
        self.records[key] = (ttl, list(values))

    def mx(self, domain: str, *hosts: tuple[int, str], ttl: int = 300) -> None:
        self.add(domain, "MX", *(f"{pref} {host}." for pref, host in hosts), ttl=ttl)

    def a(self, name: str, *addresses: str, ttl: int = 300) -> None:
        self.add(name, "A", *addresses, ttl=ttl)

    def aaaa(self, name: str, *addresses: str, ttl: int = 300) -> None:
        self.add(name, "AAAA", *addresses, ttl=ttl)

    def null_mx(self, domain: str) -> None:
        self.add(domain, "MX", "0 .")

    def fail(self, name: str) -> None:
        """Answer SERVFAIL for every query about `name`."""
        self.servfail.add(dns.name.from_text(name))

    def hang(self, name: str) -> None:
        """Never answer queries about `name` (the resolver times out)."""
        self.silent.add(dns.name.from_text(name))

    @property
    def nameserver(self) -> str:
        """The "ip:port" to put into `dns.nameservers`."""
        return f"{self.host}:{self.port}"

    def asked(self, name: str, rdtype: str) -> int:
        return self.queries[(name.lower().rstrip("."), rdtype)]

    # ------------------------------------------------------------ answering

    def answer(self, wire: bytes) -> bytes | None:
        query = dns.message.from_wire(wire)
        question = query.question[0]
        name, rdtype = question.name, question.rdtype
        self.queries[
            (name.to_text(omit_final_dot=True).lower(), dns.rdatatype.to_text(rdtype))
        ] += 1
        if name in self.silent:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if name in self.servfail:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        entry = self.records.get((name, rdtype))
        if entry is not None:
            ttl, values = entry
            response.answer.append(
                dns.rrset.from_text_list(name, ttl, dns.rdataclass.IN, rdtype, values)
            )
            return response.to_wire()
        # The SOA lets resolvers cache the negative answer (RFC 2308).
        response.authority.append(
            dns.rrset.from_text(SOA_NAME, 60, dns.rdataclass.IN, dns.rdatatype.SOA, SOA_TEXT)
        )
        if not any(known == name for known, _ in self.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        return response.to_wire()

    # ------------------------------------------------------------ serving

    async def start(self) -> DnsServer:
        loop = asyncio.get_running_loop()
        for _ in range(20):
            tcp = await asyncio.start_server(self._serve_tcp, self.host, 0)
            port = tcp.sockets[0].getsockname()[1]
            try:
                udp, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpProtocol(self), local_addr=(self.host, port)
                )
            except OSError:
                tcp.close()
                continue
            self._tcp, self._udp, self.port = tcp, udp, port
            return self
        raise RuntimeError("could not bind UDP and TCP on one port")

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                reply = self.answer(await reader.readexactly(length))
                if reply is not None:
                    writer.write(struct.pack("!H", len(reply)) + reply)
                    await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.server.answer(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)
