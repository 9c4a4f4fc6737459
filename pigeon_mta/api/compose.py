"""What a `POST /v1/messages` asks to send: an envelope and the message bytes, from either form.

- JSON (`application/json`): the fields below, built into MIME with the standard `email` package.
- Raw (`message/rfc822`): the message as written, the envelope in the query (`from`, `to`).

Everything a request says is checked here, before anything is queued; each refusal is a
`Problem` whose detail names the field. A CR or LF in a header value or name is refused, never
folded in: it would let a caller write header fields of its own choosing. The limits are checked
before the work they bound: the addresses are counted before any is parsed, and the header fields'
sizes added up before any is encoded, so that an oversized request is refused for the price of
reading it, not of building it (200,000 recipients took 2.5 s of a worker's loop to refuse).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.header import Header
from typing import Any

from pigeon_mta.api import mime, problems
from pigeon_mta.api.problems import Problem, shown
from pigeon_mta.config import LimitsSettings
from pigeon_mta.intake import intent as intents
from pigeon_mta.intake.addresses import AddressProblem, Mailbox, mailbox_key, parse_mailbox
from pigeon_mta.intake.lines import LINE_LIMIT, fold_long_lines, normalize_line_endings
from pigeon_mta.message import split_header

JSON_FIELDS = frozenset(
    {
        "from",
        "to",
        "cc",
        "bcc",
        "reply_to",
        "subject",
        "text",
        "html",
        "headers",
        "attachments",
        "lane",
        # The send intent (intake/intent.py).
        "expires_at",
        "send_at",
        "order_key",
        "metadata",
    }
)
ATTACHMENT_FIELDS = frozenset({"filename", "content_type", "content", "content_id"})
# An inline part's Content-ID as the html names it ("cid:logo"): a msg-id's characters (RFC 5322
# 3.6.4 dot-atom text, an @ allowed), never a space, angle bracket or quote.
_CONTENT_ID = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.@-]{1,200}")
# Fields of the JSON `headers` object, at most; and the characters of one header value (subject
# or `headers`), at most: longer ones are mistakes, and each costs encoding time to build.
MAX_JSON_HEADERS = 100
MAX_FIELD_VALUE = 16 * 1024
# Fields the JSON form writes itself (or, for X-Pigeon-Lane, reads from `lane`).
_OWN_HEADERS = frozenset(
    {
        "from",
        "to",
        "cc",
        "bcc",
        "reply-to",
        "subject",
        "mime-version",
        "content-type",
        "content-transfer-encoding",
        "x-pigeon-lane",
    }
)
# RFC 5322 2.2: a field name is printable US-ASCII other than the colon.
_FIELD_NAME = re.compile(r"[!-9;-~]{1,76}")
_MEDIA_TYPE = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,63}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,63}"
)
# A media type's parameter (RFC 2045 5.1): a token, "=", a token or a quoted string (printable
# ASCII, no quote or backslash inside).
_PARAMETER = re.compile(
    r"\s*([A-Za-z0-9!#$&^_.+-]{1,64})\s*=\s*"
    r"(?:([A-Za-z0-9!#$%&'*+.^_`|~-]{1,200})|\"([ !#-\[\]-~]{0,200})\")\s*"
)
# What a base64 writer may wrap its lines with (Python's encodebytes, PHP's chunk_split).
_BASE64_SPACE = str.maketrans("", "", " \t\r\n")


@dataclass(frozen=True)
class Composed:
    sender: Mailbox
    recipients: tuple[str, ...]  # envelope recipients, each once, in the order given
    data: bytes  # the message, CRLF line endings
    lane: str | None  # the JSON `lane`, None when the request names none
    intent: intents.Intent = intents.NONE  # the JSON `expires_at`, `send_at`, ...


# ---------------------------------------------------------------- JSON


def from_json(body: bytes, limits: LimitsSettings) -> Composed:
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        raise Problem(problems.INVALID_JSON, "The request body is not valid JSON.") from None
    if not isinstance(request, dict):
        raise Problem(problems.INVALID_JSON, "The request body must be a JSON object.")
    unknown = sorted(set(request) - JSON_FIELDS)
    if unknown:
        raise Problem(problems.INVALID_FIELD, f"The field '{shown(unknown[0])}' is not known.")
    if "from" not in request:
        raise Problem(problems.INVALID_FIELD, "The field 'from' is missing.")
    _check_counts(request, limits)
    sender = _address(request["from"], "from")
    to = _addresses(request.get("to"), "to")
    cc = _addresses(request.get("cc"), "cc")
    bcc = _addresses(request.get("bcc"), "bcc")
    reply_to = _addresses(request.get("reply_to"), "reply_to")
    recipients = _envelope_recipients([a for a, _name in to + cc + bcc], limits)
    if not recipients:
        raise Problem(problems.INVALID_FIELD, "The fields 'to', 'cc' and 'bcc' name no recipient.")
    subject = _string(request, "subject")
    text = _string(request, "text")
    html = _string(request, "html")
    lane = _string(request, "lane")
    if text is None and html is None:
        raise Problem(problems.INVALID_FIELD, "The request needs a 'text' or an 'html' field.")
    try:
        intent = intents.from_json(request, datetime.now(UTC))
    except intents.IntentError as exc:
        raise Problem(problems.INVALID_FIELD, f"The field '{exc.name}' {exc.problem}.") from None
    headers: list[tuple[str, str | Header]] = [("From", mime.address_list([sender], "from"))]
    if to:
        headers.append(("To", mime.address_list(to, "to")))
    if cc:
        headers.append(("Cc", mime.address_list(cc, "cc")))
    if reply_to:
        headers.append(("Reply-To", mime.address_list(reply_to, "reply_to")))
    if subject is not None:
        _check_value(subject, "subject")
        headers.append(("Subject", mime.text_value(subject, "Subject", "subject")))
    for name, value in _headers(request.get("headers")):
        headers.append((name, mime.text_value(value, name, f"headers.{name}")))
    tree = mime.body_of(text, html)
    attachments = _attachments(request)
    if attachments:
        tree = mime.with_attachments(tree, attachments)
    data = mime.flatten(headers, tree)
    _check_size(data, limits)
    return Composed(sender[0], recipients, data, lane, intent)


def _check_counts(request: Mapping[str, Any], limits: LimitsSettings) -> None:
    """The limits that bound the work of building the message, checked before that work: the
    addresses named (each once or not: a request that names more than max_recipients is refused
    unparsed), the `headers` fields, and the sizes of the header values together."""
    named = sum(
        len(value) if isinstance(value, list) else 1
        for value in (request.get(f) for f in ("to", "cc", "bcc"))
        if value is not None
    )
    if named > limits.max_recipients:
        raise Problem(
            problems.TOO_MANY_RECIPIENTS,
            f"The request names {named} recipients; limits.max_recipients allows "
            f"{limits.max_recipients}.",
        )
    reply_to = request.get("reply_to")
    if isinstance(reply_to, list) and len(reply_to) > limits.max_recipients:
        raise Problem(
            problems.INVALID_FIELD,
            f"The field 'reply_to' names {len(reply_to)} addresses; at most "
            f"{limits.max_recipients} (limits.max_recipients) are taken.",
        )
    headers = request.get("headers")
    if isinstance(headers, dict) and len(headers) > MAX_JSON_HEADERS:
        raise Problem(
            problems.INVALID_HEADER,
            f"The field 'headers' has {len(headers)} fields; at most {MAX_JSON_HEADERS}.",
        )
    values: list[tuple[str, object]] = [("subject", request.get("subject"))]
    if isinstance(headers, dict):
        values += [(f"headers.{name}", value) for name, value in headers.items()]
    size = 0
    for field, value in values:
        if not isinstance(value, str):
            continue
        if len(value) > MAX_FIELD_VALUE:
            raise Problem(
                problems.INVALID_HEADER,
                f"The field '{shown(field)}' is {len(value)} characters long; a header value "
                f"may have {MAX_FIELD_VALUE}.",
            )
        size += len(field) + len(value) + 4
    if limits.max_header_size and size > limits.max_header_size:
        raise Problem(
            problems.TOO_LARGE,
            "The header fields of the request are over limits.max_header_size "
            f"({limits.max_header_size} bytes).",
        )


def _string(request: Mapping[str, Any], name: str) -> str | None:
    value = request.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise Problem(problems.INVALID_FIELD, f"The field '{name}' must be a string.")
    if "\x00" in value:
        raise Problem(problems.INVALID_FIELD, f"The field '{name}' contains a NUL character.")
    if problems.unstorable(value):
        raise Problem(
            problems.INVALID_FIELD,
            f"The field '{name}' contains an unpaired surrogate (not a character of UTF-8).",
        )
    return value


def _check_value(value: str, field: str) -> None:
    if "\r" in value or "\n" in value:
        raise Problem(
            problems.INVALID_HEADER,
            f"The field '{shown(field)}' contains a CR or LF, which a header value may not.",
        )
    if any(ord(c) < 0x20 and c != "\t" for c in value):
        raise Problem(
            problems.INVALID_HEADER, f"The field '{shown(field)}' contains a control character."
        )


def _headers(value: object) -> list[tuple[str, str]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise Problem(problems.INVALID_FIELD, "The field 'headers' must be an object.")
    out = []
    for name, text in value.items():
        if not _FIELD_NAME.fullmatch(name):
            raise Problem(
                problems.INVALID_HEADER,
                f"The header name '{shown(name)}' in 'headers' is not a field name (printable "
                "ASCII without spaces or a colon, RFC 5322 2.2).",
            )
        if name.lower() in _OWN_HEADERS:
            raise Problem(
                problems.INVALID_HEADER,
                f"The header '{name}' in 'headers' is set from the request's own fields.",
            )
        if not isinstance(text, str):
            raise Problem(
                problems.INVALID_FIELD, f"The value of 'headers.{name}' must be a string."
            )
        _check_value(text, f"headers.{name}")
        out.append((name, text))
    return out


def _attachments(request: Mapping[str, Any]) -> list[mime.Attachment]:
    value = request.get("attachments")
    if value is None:
        return []
    if not isinstance(value, list):
        raise Problem(problems.INVALID_FIELD, "The field 'attachments' must be a list.")
    out = []
    for i, item in enumerate(value):
        where = f"attachments[{i}]"
        if not isinstance(item, dict):
            raise Problem(problems.INVALID_FIELD, f"The item '{where}' must be an object.")
        unknown = sorted(set(item) - ATTACHMENT_FIELDS)
        if unknown:
            raise Problem(
                problems.INVALID_FIELD, f"The field '{where}.{shown(unknown[0])}' is not known."
            )
        filename = _string(item, "filename") or ""
        _check_value(filename, f"{where}.filename")
        if not filename:
            raise Problem(problems.INVALID_FIELD, f"The field '{where}.filename' is missing.")
        content_type, parameters = _media_type(
            _string(item, "content_type") or "application/octet-stream", f"{where}.content_type"
        )
        encoded = _string(item, "content")
        if encoded is None:
            raise Problem(problems.INVALID_FIELD, f"The field '{where}.content' is missing.")
        try:
            content = base64.b64decode(encoded.translate(_BASE64_SPACE), validate=True)
        except (binascii.Error, ValueError):
            raise Problem(
                problems.INVALID_FIELD, f"The field '{where}.content' is not valid base64."
            ) from None
        content_id = _string(item, "content_id")
        if content_id is not None and not _CONTENT_ID.fullmatch(content_id):
            raise Problem(
                problems.INVALID_FIELD,
                f"The field '{where}.content_id' must be 1 to 200 characters of a Message-ID "
                "(letters, digits, . @ and the like; no space, angle bracket or quote).",
            )
        out.append(mime.Attachment(filename, content_type, parameters, content, content_id))
    return out


def _media_type(value: str, field: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """ "type/subtype" and its parameters ("text/csv; charset=utf-8"), each checked."""
    kind, _, rest = value.partition(";")
    kind = kind.strip()
    if not _MEDIA_TYPE.fullmatch(kind):
        raise Problem(
            problems.INVALID_FIELD,
            f"The field '{field}' is not a media type like application/pdf.",
        )
    parameters: list[tuple[str, str]] = []
    for item in rest.split(";"):
        if not item.strip():
            continue  # "text/csv;" and "a=b; ; c=d" as writers leave them
        found = _PARAMETER.fullmatch(item)
        if found is None or len(parameters) >= 8:
            raise Problem(
                problems.INVALID_FIELD,
                f"The field '{field}' has a parameter that is not name=value "
                "(a token, or a quoted string of printable ASCII), or more than 8.",
            )
        name, token, quoted = found.groups()
        parameters.append((name.lower(), token if token is not None else quoted))
    return kind, tuple(parameters)


# ---------------------------------------------------------------- addresses


def _address(value: object, field: str, *, header: bool = True) -> tuple[Mailbox, str]:
    """A mailbox and its display name from "addr@example.com" or "Name <addr@example.com>".

    As the SMTP listeners take it with SMTPUTF8: a domain in U-labels is written in A-labels,
    and a local part may be UTF-8 (RFC 6531), which the destination must then offer. A `header`
    address (JSON's fields, written into the message) must have an ASCII local part: the fields
    are written with RFC 2047 encoded words, which cannot carry one. A raw message's header is
    the client's, and its envelope addresses (`from`, `to`) may have UTF-8 local parts."""
    if not isinstance(value, str):
        raise Problem(problems.INVALID_FIELD, f"The field '{field}' must be a string address.")
    _check_value(value, field)
    text, name = value.strip(), ""
    if text.endswith(">") and "<" in text:
        name, _, text = text[:-1].rpartition("<")
        name = name.strip()
        if len(name) >= 2 and name[0] == name[-1] == '"':
            name = name[1:-1]
    parsed = parse_mailbox(text, smtputf8=True)
    if isinstance(parsed, Mailbox):
        if header and not parsed.local.isascii():
            raise Problem(
                problems.INVALID_ADDRESS,
                f"The address '{shown(text)}' in '{field}' has a non-ASCII local part, which a "
                "JSON message cannot carry in its header: send it as message/rfc822, with the "
                "header written as RFC 6532 allows.",
            )
        return parsed, name
    reason = {
        AddressProblem.SYNTAX: "is not a valid address",
        AddressProblem.NEEDS_SMTPUTF8: "has non-ASCII characters, which need SMTPUTF8",
        AddressProblem.LITERAL: "is an address literal, which pigeon-mta does not route",
    }[parsed]
    raise Problem(problems.INVALID_ADDRESS, f"The address '{shown(text)}' in '{field}' {reason}.")


def _addresses(value: object, field: str) -> list[tuple[Mailbox, str]]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise Problem(
            problems.INVALID_FIELD, f"The field '{field}' must be an address or a list of them."
        )
    return [_address(item, f"{field}[{i}]") for i, item in enumerate(value)]


def _envelope_recipients(mailboxes: list[Mailbox], limits: LimitsSettings) -> tuple[str, ...]:
    """Each mailbox once (`addresses.mailbox_key`, as the SMTP handler does)."""
    seen: dict[str, str] = {}
    for mailbox in mailboxes:
        seen.setdefault(mailbox_key(str(mailbox)), str(mailbox))
    if len(seen) > limits.max_recipients:
        raise Problem(
            problems.TOO_MANY_RECIPIENTS,
            f"The request names {len(seen)} recipients; limits.max_recipients allows "
            f"{limits.max_recipients}.",
        )
    return tuple(seen.values())


# ---------------------------------------------------------------- raw


def from_raw(body: bytes, sender: list[str], to: list[str], limits: LimitsSettings) -> Composed:
    """The message as the client wrote it; the envelope from the query parameters."""
    if len(sender) != 1:
        raise Problem(problems.INVALID_FIELD, "The query parameter 'from' must be given once.")
    if len(to) > limits.max_recipients:
        raise Problem(
            problems.TOO_MANY_RECIPIENTS,
            f"The request names {len(to)} recipients; limits.max_recipients allows "
            f"{limits.max_recipients}.",
        )
    mailbox, _name = _address(sender[0], "from", header=False)
    if not to:
        raise Problem(problems.INVALID_FIELD, "The query parameter 'to' is missing.")
    recipients = _envelope_recipients(
        [_address(t, f"to[{i}]", header=False)[0] for i, t in enumerate(to)], limits
    )
    _check_size(body, limits)
    data = normalize_line_endings(body)
    if not split_header(data).fields:
        raise Problem(
            problems.INVALID_MESSAGE,
            "The message has no header section: it must start with a field like 'From: ...'.",
        )
    if any(len(line) > LINE_LIMIT for line in data.split(b"\r\n")):
        if limits.long_lines == "refuse":
            raise Problem(
                problems.INVALID_MESSAGE,
                f"The message has a line over {LINE_LIMIT} octets (limits.long_lines = refuse).",
            )
        data, _folded = fold_long_lines(data)
    if data and not data.endswith(b"\r\n"):
        data += b"\r\n"
    return Composed(mailbox, recipients, data, None)


def _check_size(data: bytes, limits: LimitsSettings) -> None:
    if limits.max_message_size and len(data) > limits.max_message_size:
        raise Problem(
            problems.TOO_LARGE,
            f"The message is {len(data)} bytes; limits.max_message_size allows "
            f"{limits.max_message_size}.",
        )
