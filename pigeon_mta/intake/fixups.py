"""What a message submission agent adds to a message (RFC 6409 8): pure functions on bytes.

Line endings become CRLF, a missing Message-ID or Date is added at the end of the header, and a
Received and an Authentication-Results header (RFC 8601, built with authres) go on top. The
X-Pigeon-* fields, requests to pigeon-mta itself (the lane, intake/lanes.py; the send intent,
intake/intent.py), are taken out, so that they are never signed or delivered; X-Pigeon-Submitted,
a trace field, stays. Nothing else in the message is touched.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime
from email.utils import format_datetime

import authres

from pigeon_mta.intake.authserv import claims_authserv_id
from pigeon_mta.intake.lines import normalize_line_endings
from pigeon_mta.message import (
    CRLF,
    ORIGINATOR_FIELDS,
    field_name,
    field_value,
    message_id_of,
    split_header,
)

# The field a client names the lane of its message with (intake/lanes.py).
LANE_FIELD = b"x-pigeon-lane"
# The fields of requests to pigeon-mta, and the one of them that is a trace field.
PIGEON_PREFIX = b"x-pigeon-"
TRACE_FIELD = b"x-pigeon-submitted"

_HELO_UNSAFE = re.compile(r"[^\x21-\x27\x2a-\x5b\x5d-\x7e]")  # no space, parentheses, backslash


class TooManyHops(Exception):
    """The message has passed through as many hosts as `apply_fixups` allows (a routing loop)."""


@dataclass(frozen=True)
class Trace:
    """What the Received and Authentication-Results headers record about one submission."""

    hostname: str  # ours
    queue_id: str
    client_ip: str
    helo: str | None
    esmtp: bool
    smtputf8: bool
    tls_version: str | None
    tls_cipher: str | None
    auth_user: str | None
    recipients: tuple[str, ...]
    received_at: datetime


@dataclass(frozen=True)
class Fixed:
    data: bytes
    header_message_id: str | None  # the Message-ID header value (ours when it was added)
    # (name, value) of each originator field, in message order: for the sender policy.
    address_fields: list[tuple[str, str]]
    # The values of the X-Pigeon-Lane fields the client wrote, in order (the fields are removed).
    lane_fields: tuple[str, ...] = ()
    # Every other X-Pigeon-* field it wrote but X-Pigeon-Submitted, (name as written, value), in
    # order: the send intent's (intake/intent.py). Removed too.
    intent_fields: tuple[tuple[str, str], ...] = ()
    # BLAKE2b-128 of the message's body as the client sent it (line endings made CRLF): the
    # same message sent again has the same digest.
    content_digest: bytes = b""


def apply_fixups(
    data: bytes,
    trace: Trace,
    *,
    new_message_id: str,
    max_header_size: int = 0,
    max_hops: int = 0,
    top: bytes | None = None,
) -> Fixed:
    """The message as queued. Raises message.HeaderTooLarge past `max_header_size`, TooManyHops
    when the message holds `max_hops` Received fields already, ours to come (0: no limit).
    `top`: the trace fields to put on top instead of the Received and Authentication-Results of
    an SMTP submission (the HTTP API writes its own, intake/accept.py http_trace)."""
    data = normalize_line_endings(data)
    if data and not data.endswith(CRLF):
        data += CRLF
    split = split_header(data, max_size=max_header_size)
    # The body as the client sent it: a retry has the same one, whatever header fields its
    # software wrote again (a Date, a Received).
    digest = hashlib.blake2b(split.rest, digest_size=16).digest()
    # Each field's name once (four lookups below would otherwise parse it four times).
    named = [(field_name(f), f) for f in split.fields]
    # Only the header section's fields count: a Received line quoted in the body is no hop.
    if max_hops and sum(1 for n, _f in named if n == b"received") >= max_hops:
        raise TooManyHops(f"the message passed {max_hops} hosts already")
    named = [(n, f) for n, f in named if not _forged_results(n, f, trace.hostname)]
    lane_fields = tuple(field_value(f) for n, f in named if n == LANE_FIELD)
    requests = [(n, f) for n, f in named if n.startswith(PIGEON_PREFIX) and n != TRACE_FIELD]
    intent_fields = tuple(
        (f.split(b":", 1)[0].strip().decode("ascii", "replace"), field_value(f))
        for n, f in requests
        if n != LANE_FIELD
    )
    if requests:
        named = [(n, f) for n, f in named if not (n.startswith(PIGEON_PREFIX) and n != TRACE_FIELD)]
    fields = [f for _n, f in named]
    names = {n for n, _f in named}
    added: list[bytes] = []
    header_message_id = message_id_of([f for n, f in named if n == b"message-id"])
    if b"message-id" not in names:
        header_message_id = new_message_id
        added.append(b"Message-ID: <" + new_message_id.encode("utf-8") + b">" + CRLF)
    if b"date" not in names:
        added.append(b"Date: " + format_datetime(trace.received_at).encode("ascii") + CRLF)
    rest = split.rest
    if not split.separated and rest:
        rest = CRLF + rest  # a body with no blank line before it must not become header
    if top is None:
        top = received_header(trace) + authentication_results(trace)
    out = b"".join((top, *fields, *added, rest))
    originators = [(n.decode("ascii"), field_value(f)) for n, f in named if n in ORIGINATOR_FIELDS]
    return Fixed(out, header_message_id, originators, lane_fields, intent_fields, digest)


def received_header(trace: Trace) -> bytes:
    """RFC 5321 4.4 trace line; the protocol name per RFC 3848 and RFC 6531."""
    helo = _HELO_UNSAFE.sub("?", trace.helo or "")[:255] or "unknown"
    protocol = ("UTF8SMTP" if trace.smtputf8 else "ESMTP" if trace.esmtp else "SMTP") + (
        ("S" if trace.tls_version else "") + ("A" if trace.auth_user else "")
    )
    lines = [f"Received: from {helo} ([{trace.client_ip}])"]
    if trace.tls_version:
        lines.append(f"\t(using {trace.tls_version} with cipher {trace.tls_cipher or 'unknown'})")
    lines.append(f"\tby {trace.hostname} (pigeon-mta) with {protocol} id {trace.queue_id}")
    if len(trace.recipients) == 1:
        # Only for one recipient: naming one of several would tell each about the others.
        lines.append(f"\tfor <{trace.recipients[0]}>;")
    else:
        lines[-1] += ";"
    lines.append(f"\t{format_datetime(trace.received_at)}")
    return ("\r\n".join(lines) + "\r\n").encode("utf-8")


def authentication_results(trace: Trace) -> bytes:
    return _authentication_results(trace.hostname, trace.auth_user)


@functools.lru_cache(maxsize=256)
def _authentication_results(hostname: str, auth_user: str | None) -> bytes:
    """The field for a hostname and SMTP AUTH user: the same for every message of that pair."""
    result = (
        authres.SMTPAUTHAuthenticationResult(result="pass", smtp_auth=auth_user)
        if auth_user
        else authres.SMTPAUTHAuthenticationResult(result="none")
    )
    header = authres.AuthenticationResultsHeader(authserv_id=hostname, results=[result])
    return str(header).encode("utf-8") + CRLF


def _forged_results(name: bytes, field: bytes, hostname: str) -> bool:
    """An Authentication-Results field claiming to be ours: RFC 8601 5 says remove it."""
    return name == b"authentication-results" and claims_authserv_id(field_value(field), hostname)
