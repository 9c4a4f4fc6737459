"""Pure address rules: SMTP paths (RFC 5321 4.1.2), mailboxes and client IPs.

Domains are spelled by pigeon_mta/domains.py, and the domains of From: and the other originator
fields are read by pigeon_mta/message.py.

Relaying is decided by who the client is (trusted network or SMTP AUTH), never by what an address
looks like, so no percent hack, bang path or source route can open the relay. These rules only
make sure that what is queued is one well-formed mailbox whose domain is the routing domain.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pigeon_mta.domains import normalize_domain

# RFC 5321 4.5.3.1.3: a path is at most 256 octets including the angle brackets.
MAX_PATH_OCTETS = 254
# RFC 5321 4.5.3.1.1 says 64; real senders exceed it (VERP, SRS), so be lenient like Postfix.
MAX_LOCAL_PART_OCTETS = 128

_ATEXT = r"A-Za-z0-9!#$%&'*+/=?^_`{|}~\-"
_DOT_ATOM_ASCII = re.compile(rf"[{_ATEXT}]+(?:\.[{_ATEXT}]+)*\Z")
# RFC 6531 3.3: with SMTPUTF8 any non-ASCII UTF-8 character is also atext.
_DOT_ATOM_UTF8 = re.compile(rf"[{_ATEXT}\u0080-\U0010ffff]+(?:\.[{_ATEXT}\u0080-\U0010ffff]+)*\Z")
_QUOTED_ASCII = re.compile(r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"\Z')
_QUOTED_UTF8 = re.compile(r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e\u0080-\U0010ffff]|\\[\x20-\x7e])*"\Z')


class AddressProblem(enum.Enum):
    SYNTAX = "syntax"  # not one well-formed mailbox
    NEEDS_SMTPUTF8 = "needs_smtputf8"  # non-ASCII without the SMTPUTF8 MAIL parameter
    LITERAL = "literal"  # an address literal ("user@[192.0.2.1]"): not routed by pigeon-mta


@dataclass(frozen=True)
class Mailbox:
    local: str
    domain: str  # lower-case, ASCII (A-labels), no trailing dot

    def __str__(self) -> str:
        return f"{self.local}@{self.domain}"


def parse_mailbox(text: str, *, smtputf8: bool) -> Mailbox | AddressProblem:
    """One mailbox from the address of a MAIL or RCPT command (angle brackets already removed)."""
    if not text or len(text.encode("utf-8", "surrogatepass")) > MAX_PATH_OCTETS:
        return AddressProblem.SYNTAX
    if any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in text):
        # Control characters, and surrogates (bytes that were not UTF-8).
        return AddressProblem.SYNTAX
    if not text.isascii() and not smtputf8:
        return AddressProblem.NEEDS_SMTPUTF8
    local, at, domain_text = text.rpartition("@")
    if not at or not local or not domain_text:
        return AddressProblem.SYNTAX
    if len(local.encode("utf-8")) > MAX_LOCAL_PART_OCTETS:
        return AddressProblem.SYNTAX
    dot_atom, quoted = (
        (_DOT_ATOM_UTF8, _QUOTED_UTF8) if smtputf8 else (_DOT_ATOM_ASCII, _QUOTED_ASCII)
    )
    if not (dot_atom.match(local) or quoted.match(local)):
        return AddressProblem.SYNTAX
    if domain_text.startswith("["):
        return AddressProblem.LITERAL
    domain = normalize_domain(domain_text)
    if domain is None:
        return AddressProblem.SYNTAX
    return Mailbox(local, domain)


def split_path(arg: str) -> tuple[str | None, str | None]:
    """(address, parameters) of a MAIL/RCPT argument, as aiosmtpd's `_getaddr` returns them.

    The RFC 5321 4.1.2 path "<[@route,@route:]mailbox>"; a source route is ignored (RFC 5321
    Appendix C). "<>" stays "<>" (the null reverse-path); an address without brackets is taken up
    to the first space, as many MTAs do. None means malformed.
    """
    if not arg:
        return "", ""
    if not arg.startswith("<"):
        address, _, rest = arg.partition(" ")
        return address, rest.strip()
    end = _closing_bracket(arg)
    if end < 0:
        return None, None
    inner, rest = arg[1:end].strip(), arg[end + 1 :]
    if rest and not rest[0].isspace():
        return None, None
    if not inner:
        return "<>", rest.strip()
    if inner.startswith("@"):
        route_end = inner.find(":")
        if route_end < 0:
            return None, None
        inner = inner[route_end + 1 :]
    return inner, rest.strip()


def _closing_bracket(arg: str) -> int:
    """Index of the ">" that closes the path, skipping quoted strings; -1 if there is none."""
    if '"' not in arg:
        return arg.find(">")
    quoted = escaped = False
    for index, char in enumerate(arg):
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == ">" and not quoted:
            return index
    return -1


# ---------------------------------------------------------------- clients


def client_address(peer: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The client's IP from a socket peer name; an IPv4-mapped IPv6 address becomes IPv4."""
    if not isinstance(peer, tuple) or not peer:
        return None
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def in_networks(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None,
    networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
) -> bool:
    return ip is not None and any(ip.version == net.version and ip in net for net in networks)


def mailbox_key(address: str) -> str:
    """What makes two spellings one mailbox: the local part as written, the domain in any case."""
    local, _, domain = address.rpartition("@")
    return f"{local}@{domain.lower()}"
