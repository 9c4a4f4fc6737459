"""Independent DKIM verifiers for tests, and the DNS server they look keys up in.

    message ──► opendkim-testmsg ─┐  (libopendkim; in its own mount namespace, where
            ──► Mail::DKIM (Perl) ┼─► DkimZone     /etc/resolv.conf names the zone's address)
            ──► dkimpy            ┘  127.0.0.x:53, UDP + TCP, answers TXT for the test's records

`DkimZone` is a small authoritative DNS server (dnspython for the wire format) on a loopback
address of its own; it must use port 53 because the system resolver that libopendkim uses has no
port setting. opendkim-testmsg always asks DNS, so it runs under `unshare --mount` with a
private /etc/resolv.conf bound over the real one. Bookworm's Mail::DKIM cannot check Ed25519
signatures (it reports them as invalid); opendkim-testmsg and dkimpy can. libopendkim checks
headers strictly: a message without exactly one From and one Date field is a "Syntax error".

Use:
    with DkimZone({"s1._domainkey.example.com": "v=DKIM1; k=rsa; p=..."}) as zone:
        assert opendkim_verify(message, zone).ok
        assert [s.result for s in mail_dkim_verify(message, zone)] == ["pass"]
        assert dkimpy_verify(message, zone) == [True]
"""

from __future__ import annotations

import contextlib
import errno
import random
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import dkim as dkimpy
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.TXT
import dns.rrset

from pigeon_mta.dkim import txt_strings

_UDP_PLAIN_MAX = 512  # RFC 1035 4.2.1, without EDNS


class DkimZone:
    """An authoritative DNS server answering TXT queries for `records` (name -> value)."""

    def __init__(self, records: Mapping[str, str] | None = None) -> None:
        self._records: dict[str, str] = {}
        for name, value in (records or {}).items():
            self.add(name, value)
        self.host = ""
        self.port = 53
        self._udp: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def add(self, name: str, value: str) -> None:
        self._records[_key(name)] = value

    def start(self) -> DkimZone:
        # Port 53 on a loopback address nobody else picked (127.0.0.0/8 is all ours to bind).
        for _ in range(50):
            host = f"127.0.0.{random.randint(2, 250)}"
            if host == "127.0.0.53":  # systemd-resolved's stub, where there is one
                continue
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                udp.bind((host, self.port))
                tcp.bind((host, self.port))
            except OSError as exc:
                udp.close()
                tcp.close()
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise
            break
        else:
            raise RuntimeError("no free 127.0.0.x:53 for the test DNS server")
        tcp.listen(16)
        udp.settimeout(0.2)
        tcp.settimeout(0.2)
        self.host, self._udp, self._tcp = host, udp, tcp
        self._threads = [
            threading.Thread(target=self._serve_udp, daemon=True),
            threading.Thread(target=self._serve_tcp, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in (self._udp, self._tcp):
            if sock is not None:
                sock.close()

    def __enter__(self) -> DkimZone:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def lookup(self, name: str) -> str | None:
        return self._records.get(_key(name))

    def answer(self, wire: bytes, limit: int | None) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA | dns.flags.RA
        known = False
        for question in query.question:
            value = self.lookup(question.name.to_text())
            known = known or value is not None
            if value is not None and question.rdtype == dns.rdatatype.TXT:
                rdata = dns.rdtypes.ANY.TXT.TXT(
                    dns.rdataclass.IN, dns.rdatatype.TXT, txt_strings(value)
                )
                response.answer.append(dns.rrset.from_rdata(question.name, 60, rdata))
        if not known:
            response.set_rcode(dns.rcode.NXDOMAIN)
        if limit is None:
            return response.to_wire()
        if query.edns >= 0:
            limit = max(limit, query.payload)
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            # Too big for UDP: say so (TC), and the resolver asks again over TCP.
            truncated = dns.message.make_response(query)
            truncated.flags |= dns.flags.AA | dns.flags.RA | dns.flags.TC
            return truncated.to_wire()

    def _serve_udp(self) -> None:
        assert self._udp is not None
        while not self._stopping.is_set():
            try:
                wire, peer = self._udp.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            reply = self.answer(wire, _UDP_PLAIN_MAX)
            if reply is not None:
                self._udp.sendto(reply, peer)

    def _serve_tcp(self) -> None:
        assert self._tcp is not None
        while not self._stopping.is_set():
            try:
                conn, _peer = self._tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError, struct.error):
                    while True:
                        header = _recv_exactly(conn, 2)
                        if not header:
                            break
                        (length,) = struct.unpack("!H", header)
                        reply = self.answer(_recv_exactly(conn, length), None)
                        if reply is None:
                            break
                        conn.sendall(struct.pack("!H", len(reply)) + reply)


def _recv_exactly(conn: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = conn.recv(count - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _key(name: str) -> str:
    return name.lower().rstrip(".")


# ---------------------------------------------------------------- verifiers


@dataclass(frozen=True)
class OpendkimResult:
    ok: bool
    output: str  # opendkim-testmsg says nothing when every check passed


def opendkim_verify(message: bytes, zone: DkimZone) -> OpendkimResult:
    """Verify with opendkim-testmsg (libopendkim), looking keys up in `zone`."""
    if shutil.which("opendkim-testmsg") is None:
        raise RuntimeError("opendkim-testmsg is missing: apt-get install opendkim-tools")
    with tempfile.TemporaryDirectory(prefix="pigeon-dkim-") as tmp:
        resolv = Path(tmp) / "resolv.conf"
        resolv.write_text(f"nameserver {zone.host}\noptions timeout:2 attempts:2\n")
        proc = subprocess.run(
            [
                "unshare",
                "--mount",
                "sh",
                "-c",
                'mount --bind "$1" /etc/resolv.conf && exec opendkim-testmsg -t "$2"',
                "sh",
                str(resolv),
                tmp,
            ],
            input=message,
            capture_output=True,
            timeout=60,
        )
    output = (proc.stdout + proc.stderr).decode("utf-8", "replace").strip()
    return OpendkimResult(ok=proc.returncode == 0 and not output, output=output)


@dataclass(frozen=True)
class MailDkimSignature:
    result: str  # pass, fail, invalid, none, temperror, ...
    domain: str
    selector: str
    algorithm: str
    detail: str


_MAIL_DKIM_SCRIPT = r"""
use strict;
use warnings;
use Mail::DKIM::Verifier;
use Mail::DKIM::DNS;
use Net::DNS::Resolver;
my ($nameserver, $port) = @ARGV;
Mail::DKIM::DNS::resolver(Net::DNS::Resolver->new(
    nameservers => [$nameserver], port => $port, recurse => 1,
    udp_timeout => 5, tcp_timeout => 5, retry => 2));
my $dkim = Mail::DKIM::Verifier->new();
binmode STDIN;
local $/;
my $message = <STDIN>;
$dkim->PRINT($message);
$dkim->CLOSE;
foreach my $sig ($dkim->signatures) {
    print join("\t", $sig->result // "", $sig->domain // "", $sig->selector // "",
               $sig->algorithm // "", $sig->result_detail // ""), "\n";
}
"""


def mail_dkim_verify(message: bytes, zone: DkimZone) -> list[MailDkimSignature]:
    """Verify with Perl's Mail::DKIM; one result per DKIM-Signature field, top first."""
    proc = subprocess.run(
        ["perl", "-e", _MAIL_DKIM_SCRIPT, zone.host, str(zone.port)],
        input=message,
        capture_output=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"Mail::DKIM failed: {proc.stderr.decode(errors='replace')}")
    return [
        MailDkimSignature(*line.split("\t", 4))
        for line in proc.stdout.decode("utf-8", "replace").splitlines()
        if line
    ]


def dkimpy_verify(message: bytes, zone: DkimZone) -> list[bool]:
    """Verify each DKIM-Signature field with dkimpy, keys from `zone` (read directly)."""

    def dnsfunc(name: bytes, timeout: int = 5) -> bytes | None:
        value = zone.lookup(name.decode("ascii"))
        return value.encode("ascii") if value is not None else None

    def check(index: int) -> bool:
        try:
            return bool(dkimpy.DKIM(message).verify(idx=index, dnsfunc=dnsfunc))
        except dkimpy.DKIMException:
            return False

    count = sum(
        1 for name, _value in dkimpy.rfc822_parse(message)[0] if name.lower() == b"dkim-signature"
    )
    return [check(i) for i in range(count)]


@contextlib.contextmanager
def dkim_zone(records: Mapping[str, str]) -> Iterator[DkimZone]:
    with DkimZone(records) as zone:
        yield zone
