"""The header section of a message (RFC 5322 2.1, 2.2): where it ends, its fields, and the From:
domain that the sender policy and the DKIM signer both go by. Pure functions on bytes.

The fields are read by one of two rules, because two jobs need them:

- `split_header` is reception's. A client may submit anything, and the message must be queued
  as it came: the header section ends at the first blank line or at the first line that is
  neither a field nor a continuation, which then starts the body (apply_fixups puts the blank
  line before it). It never fails.
- `signing_fields` is the DKIM signer's, the rule of dkimpy's `rfc822_parse`: a signature holds
  only if verifiers hash the same fields, so a line that is not a field is an error (the message
  goes out unsigned rather than signed on a guess), and an mbox "From " line is skipped.

A message as queued went through `split_header`, and on it the two rules give the same fields
(tests/unit/test_message.py checks it). Both are linear in the header's size: a field's lines are
joined once it is complete (adding them one by one copied the field again for every line: a
header folded into 80,000 lines took a second).

An originator field's domains are read by `address_domains`, within the bounds of
header_bounds.py; the sender policy checks them, and `from_domain`, the domain the signer signs
for, is the one they name. One parse for both, so that a message is never signed for a domain
the policy did not check.
"""

from __future__ import annotations

import email.policy
import functools
import re
from dataclasses import dataclass
from email.errors import InvalidHeaderDefect, NonPrintableDefect

from pigeon_mta.domains import normalize_domain
from pigeon_mta.header_bounds import FieldBounds, FieldProblem, split_addresses

CRLF = b"\r\n"
# The fields that name who wrote or sent a message (RFC 5322 3.6.2, 3.6.6), lower-case.
ORIGINATOR_FIELDS = frozenset({b"from", b"sender", b"resent-from", b"resent-sender"})

# A header field name: printable ASCII except the colon (RFC 5322 2.2), then the colon.
_FIELD_NAME = re.compile(rb"[\x21-\x39\x3b-\x7e]+:")
# dkimpy's (rfc822_parse): the same names, matched up to the first colon.
_SIGNING_FIELD_NAME = re.compile(rb"([\x21-\x7e]+?):")
# The end of the header section as dkimpy finds it: the first empty line, whatever its line ends.
_HEADER_END = re.compile(rb"\r?\n\r?\n")
_LINE_END = re.compile(rb"\r?\n")
_WSP = b" \t"
_DEFAULT_BOUNDS = FieldBounds()


def split_at_blank_line(message: bytes) -> tuple[bytes, bytes]:
    """(header section without its last line end, body after the blank line); the whole message
    and b"" when there is no blank line. CRLF and bare LF line ends alike, as dkimpy reads them."""
    end = _HEADER_END.search(message)
    if end is None:
        return message, b""
    return message[: end.start()], message[end.end() :]


# ---------------------------------------------------------------- reception's rule


@dataclass(frozen=True)
class SplitMessage:
    fields: list[bytes]  # whole header fields, continuation lines and CRLF included
    rest: bytes  # the blank separator line and the body; b"" when the message is all header
    separated: bool  # whether `rest` starts with the blank line


class HeaderTooLarge(Exception):
    """The header section is larger than the limit `split_header` was given."""


def split_header(data: bytes, *, max_size: int = 0) -> SplitMessage:
    """Header fields of `data` (CRLF line ends) up to the first blank line, or up to the first
    line that is not a field. With `max_size`, a header section longer than that raises
    HeaderTooLarge as soon as it is seen (the rest is not looked at)."""
    fields: list[list[bytes]] = []  # each field's lines
    pos = 0
    size = len(data)
    rest, separated = b"", False
    while pos < size:
        end = data.find(CRLF, pos)
        end = size if end < 0 else end + 2
        line = data[pos:end]
        if line == CRLF:
            rest, separated = data[pos:], True
            break
        if line[:1] in (b" ", b"\t") and fields:
            fields[-1].append(line)
        elif _FIELD_NAME.match(line):
            fields.append([line if line.endswith(CRLF) else line + CRLF])
        else:
            rest = data[pos:]
            break
        if max_size and end > max_size:
            raise HeaderTooLarge(f"the header section is over {max_size} bytes")
        pos = end
    return SplitMessage([b"".join(lines) for lines in fields], rest, separated)


def field_name(field: bytes) -> bytes:
    """The lower-case name of a whole field from `split_header`."""
    return field.split(b":", 1)[0].strip().lower()


def field_value(field: bytes) -> str:
    """The unfolded value of a whole field from `split_header`."""
    return unfold(field.split(b":", 1)[1])


def unfold(raw: bytes) -> str:
    """A field value (what follows the colon) unfolded (RFC 5322 2.2.3) and stripped, as text
    (bytes that are not UTF-8 are replaced)."""
    return raw.replace(CRLF, b"").strip().decode("utf-8", "replace")


def message_id_of(fields: list[bytes]) -> str | None:
    """The first Message-ID value without angle brackets, fit for a text column; None if empty."""
    for field in fields:
        if field_name(field) == b"message-id":
            value = field_value(field)
            text = "".join(c for c in value if c.isprintable()).strip().strip("<>").strip()
            return text[:998] or None
    return None


# ---------------------------------------------------------------- the signer's rule


class UnreadableHeader(Exception):
    """The header section does not parse by `signing_fields`' rule, or its From: field is beyond
    the bounds of header_bounds.py: nothing can be signed for it."""


def signing_fields(header: bytes) -> list[tuple[bytes, bytes]]:
    """The fields of a header section (from `split_at_blank_line`) as (name, value), as dkimpy's
    `rfc822_parse` gives them: the value is what follows the colon, every line of it ended with
    CRLF. An mbox "From " line is skipped; any other line that neither starts a field nor
    continues one raises UnreadableHeader."""
    names: list[bytes] = []
    lines_of: list[list[bytes]] = []
    for line in _LINE_END.split(header):
        if not line:
            break  # the end of the header section
        if line[0] in _WSP:
            if not lines_of:
                raise UnreadableHeader("malformed header section: it starts with a continuation")
            lines_of[-1].append(line)
            continue
        match = _SIGNING_FIELD_NAME.match(line)
        if match is not None:
            names.append(match.group(1))
            lines_of.append([line[match.end() :]])
        elif not line.startswith(b"From "):
            raise UnreadableHeader(f"malformed header section: unexpected characters in {line!r}")
    return [
        (name, b"\r\n".join(lines) + b"\r\n") for name, lines in zip(names, lines_of, strict=True)
    ]


# ---------------------------------------------------------------- the From: domain


def address_domains(value: str, bounds: FieldBounds) -> set[str] | FieldProblem:
    """The domains (`normalize_domain`'s spelling) of every address in one From:, Sender:,
    Resent-From: or Resent-Sender: field value (an empty set when it names none), or why they
    cannot be read: beyond `bounds`, or not parsed by `_parsed_domains`."""
    addresses = split_addresses(value, bounds)
    if isinstance(addresses, FieldProblem):
        return addresses
    return _parsed_domains(addresses)


def from_domain(message: bytes, bounds: FieldBounds = _DEFAULT_BOUNDS) -> str | None:
    """The one domain of the From: field of `message`, for the signer: None when there is no
    single From: field (RFC 5322 3.6), when `address_domains` refuses its addresses, or when they
    do not share one domain (then nobody's key applies).

    Raises UnreadableHeader when the header section does not parse as the signer reads it, or the
    From: field is beyond `bounds`: such a message is sent unsigned, never held."""
    header, _body = split_at_blank_line(message)
    values = [unfold(raw) for name, raw in signing_fields(header) if name.lower() == b"from"]
    if len(values) != 1:
        return None
    addresses = split_addresses(values[0], bounds)
    if isinstance(addresses, FieldProblem):
        raise UnreadableHeader(f"the From: field {addresses.value}")
    domains = _parsed_domains(addresses)
    if isinstance(domains, FieldProblem) or len(domains) != 1:
        return None
    return domains.pop()


def _parsed_domains(addresses: list[str]) -> set[str] | FieldProblem:
    """The domains of addresses cut by `split_addresses`; UNPARSEABLE if any is refused."""
    domains: set[str] = set()
    for text in addresses:
        found = _address_domains(text)
        if found is None:
            return FieldProblem.UNPARSEABLE
        domains.update(found)
    return domains


# The strict parser costs about 0.1 ms for a plain address, several times dkimpy's header path for
# a whole message, and a sender writes the same From: on every message: results are kept for the
# most recent addresses (each at most header_bounds.MAX_ADDRESS_LENGTH characters).
@functools.lru_cache(maxsize=4096)
def _address_domains(text: str) -> frozenset[str] | None:
    """The domains of one address (a group may name several) as the standard library's strict
    parser reads it (its cost bounded by header_bounds.py); None when it is refused. Obsolete
    syntax (a period in a display name) is accepted; an invalid address, a missing domain, an
    address literal or a control character is not, and neither is anything the parser fails on:
    nobody can vouch for what it cannot read."""
    try:
        header = email.policy.default.header_factory("From", text)
        parsed, defects = header.addresses, header.defects
    except Exception:  # the parser's own failure on odd input: fail closed
        return None
    if any(isinstance(d, InvalidHeaderDefect | NonPrintableDefect) for d in defects):
        return None
    domains = set()
    for address in parsed:
        domain = normalize_domain(address.domain)
        if domain is None:
            return None
        domains.add(domain)
    return frozenset(domains)
