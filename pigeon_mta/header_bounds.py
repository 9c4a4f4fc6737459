"""How much of an address header field (From:, Sender:, Resent-From:, ...) pigeon-mta will parse.

The standard library's parsers read these fields, but they were not made for hostile input: the
strict one (email.headerregistry) takes time quadratic in the length of one address (a display
name of 8,000 characters of "x.x.x" takes most of a second), both recurse once per nested comment
(20,000 nested comments raise RecursionError), and a From: of 50,000 addresses held a worker's
event loop for 14 s. So a field is first measured here, in one linear pass that parses nothing, and
cut into its addresses; a field beyond the bounds is never handed to a parser (message.py):
reception refuses it, the DKIM signer leaves the message unsigned.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Nobody nests comments (RFC 5322 3.2.2) more than a level or two; the parsers recurse on each.
MAX_COMMENT_DEPTH = 8
# One address with its display name and comments. RFC 5321 4.5.3.1.3 allows a 256-octet path;
# the rest leaves room for a display name in encoded words (RFC 2047), whose length triples text.
# Parsing cost grows with the square of this, not of the whole field.
MAX_ADDRESS_LENGTH = 512


class FieldProblem(enum.Enum):
    """Why a field is not parsed; the value completes "the From: header ..."."""

    TOO_LONG = "is too long"
    TOO_MANY_ADDRESSES = "has too many addresses"
    UNPARSEABLE = "cannot be parsed"


@dataclass(frozen=True)
class FieldBounds:
    """`limits.max_from_addresses` and `limits.max_from_length` (config.py)."""

    max_addresses: int = 100
    max_length: int = 8192  # characters of the unfolded value


def split_addresses(value: str, bounds: FieldBounds) -> list[str] | FieldProblem:
    """The field's addresses as written (each with its display name and comments), cut at the
    commas of the address list (RFC 5322 3.4), blank ones left out; or why the field is not to
    be parsed. A comma inside a quoted string, a comment or angle brackets cuts nothing."""
    if len(value) > bounds.max_length:
        return FieldProblem.TOO_LONG
    parts: list[str] = []
    start = depth = 0
    quoted = escaped = angle = False
    for index, char in enumerate(value):
        if escaped:
            escaped = False
        elif char == "\\" and (quoted or depth):
            escaped = True  # a quoted-pair (RFC 5322 3.2.1)
        elif quoted:
            quoted = char != '"'
        elif char == "(":
            depth += 1
            if depth > MAX_COMMENT_DEPTH:
                return FieldProblem.UNPARSEABLE
        elif depth:
            depth -= char == ")"
        elif char == '"':
            quoted = True
        elif char in "<>":
            angle = char == "<"
        elif char == "," and not angle:
            parts.append(value[start:index])
            start = index + 1
            if len(parts) >= bounds.max_addresses:
                return FieldProblem.TOO_MANY_ADDRESSES
    parts.append(value[start:])
    addresses = [part for part in parts if part.strip()]
    if any(len(address) > MAX_ADDRESS_LENGTH for address in addresses):
        return FieldProblem.TOO_LONG
    return addresses
