"""The AUTH parameter of MAIL (RFC 4954 section 5), which aiosmtpd does not know.

A relaying MTA (Exim, Postfix) that authenticated says with `AUTH=<mailbox>` which of its own users
submitted the message, or `AUTH=<>` when it does not know. It is the client's claim: pigeon-mta
records it with the message and never uses it for a policy decision (those go by the credential of
this connection).
"""

from __future__ import annotations

import enum
import re

from aiosmtpd.smtp import Envelope

from pigeon_mta.intake.addresses import AddressProblem, Mailbox, parse_mailbox, split_path

# RFC 3461 section 4: xchar is any printable ASCII but "+" and "="; hexchar is "+" and two hex
# digits (upper case in the RFC; lower case is taken too).
_XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-Fa-f]{2})+\Z")
_HEXCHAR = re.compile(r"\+([0-9A-Fa-f]{2})")


class Malformed(enum.Enum):
    """The AUTH= value is not xtext, or its decoded text is not "<>" nor an addr-spec."""

    AUTH = "auth"


class TransactionEnvelope(Envelope):
    """aiosmtpd's envelope with the AUTH= value of its MAIL command: "" for `AUTH=<>`, the
    decoded mailbox otherwise, None when the client gave none."""

    auth_param: str | None = None


def take_auth_param(arg: str) -> tuple[str, str | Malformed | None]:
    """Split the AUTH= parameter off the argument of a MAIL command ("FROM:<path> params").

    Returns the argument without it, for aiosmtpd's own checks (which upper-case every parameter
    and refuse any it does not know), and the decoded value. An argument whose path cannot be
    found is returned whole: aiosmtpd answers its syntax error.
    """
    if arg[:5].upper() != "FROM:":
        return arg, None
    rest = arg[5:].strip()
    address, params = split_path(rest)
    if address is None or not params:
        return arg, None
    head = rest[: len(rest) - len(params)].rstrip()
    kept: list[str] = []
    values: list[str] = []
    for param in params.split():
        keyword, eq, value = param.partition("=")
        if keyword.upper() == "AUTH":
            values.append(value if eq else "")
        else:
            kept.append(param)
    if not values:
        return arg, None
    stripped = " ".join([f"FROM:{head}", *kept])
    if len(values) > 1:
        return stripped, Malformed.AUTH  # RFC 5321 4.1.2: a parameter is given once
    return stripped, decode_auth_value(values[0])


def decode_auth_value(xtext: str) -> str | Malformed:
    """ "" for `<>`, the mailbox for an xtext-encoded addr-spec (RFC 4954 section 5)."""
    if not _XTEXT.match(xtext):
        return Malformed.AUTH
    try:
        text = _HEXCHAR.sub(lambda m: chr(int(m.group(1), 16)), xtext)
        # Hexchars encode octets: a non-ASCII mailbox arrives as its UTF-8 octets.
        text = text.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return Malformed.AUTH
    if text == "<>":
        return ""
    parsed = parse_mailbox(text, smtputf8=True)
    # An address literal is a valid addr-spec here: nothing is routed to it.
    if isinstance(parsed, Mailbox) or parsed is AddressProblem.LITERAL:
        return text
    return Malformed.AUTH
