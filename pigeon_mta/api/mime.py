"""The JSON form of `POST /v1/messages` built into a MIME message (api/compose.py checks every
value first): header fields, the text and html parts, attachments, CRLF bytes.

The email package's compat32 classes (email.mime, email.header), not EmailMessage: its header
objects parse back every value set and fold it again when written, about 0.5 ms of a 5 KB
message's 0.7 ms (bench/README.md, "HTTP API and webhooks"). Every value here is checked before
it is set (addresses by parse_mailbox, text for CR, LF and control characters), so there is
nothing left for them to find; what they did besides, encoded words for non-ASCII text and
folding at 78 columns, the compat32 generator does as well.
"""

from __future__ import annotations

import email.errors
import email.policy
import urllib.parse
from dataclasses import dataclass
from email import encoders
from email.charset import QP, Charset
from email.header import Header
from email.message import Message
from email.mime.base import MIMEBase
from email.mime.multipart import MIMEMultipart
from email.mime.nonmultipart import MIMENonMultipart
from email.mime.text import MIMEText
from email.utils import formataddr
from typing import Any

from pigeon_mta.api import problems
from pigeon_mta.api.problems import Problem, shown
from pigeon_mta.intake.addresses import Mailbox


class _Write(email.policy.Compat32):
    """compat32 that writes a field which fits on its line as it is: compat32 makes a Header of
    every value to fold it, a third of the time the message takes to write."""

    def _fold(self, name: str, value: Any, sanitize: bool) -> str:
        if (
            isinstance(value, str)
            and len(name) + 2 + len(value) <= (self.max_line_length or 78)
            and value.isascii()
            and "\r" not in value
            and "\n" not in value
        ):
            return f"{name}: {value}{self.linesep}"
        return str(super()._fold(name, value, sanitize))  # type: ignore[misc]


_WRITE = _Write(linesep="\r\n")
_LINE = _WRITE.max_line_length or 78
_UTF8 = Charset("utf-8")
_UTF8.body_encoding = QP  # quoted-printable: 7-bit for destinations without 8BITMIME
_MIME_FIELDS = ("MIME-Version", "Content-Type", "Content-Transfer-Encoding")
# A word the generator cannot fold: past this, a field name and it would not fit RFC 5322's 998.
_LONGEST_WORD = 900
# A filename longer than this (or not ASCII) goes in RFC 2231 continuations, which fold.
_SHORT_FILENAME = 60
# RFC 2231 / RFC 5987 attr-char: what an extended parameter value keeps unencoded.
_ATTR_CHARS = "!#$&+-.^_`|~"


def address_list(addresses: list[tuple[Mailbox, str]], field: str) -> str:
    """`Name <local@domain>, ...`: a name quoted where it needs it, encoded when not ASCII."""
    try:
        return ", ".join(
            formataddr((name, str(mailbox)), charset=_UTF8) for mailbox, name in addresses
        )
    except (ValueError, UnicodeError):
        raise Problem(
            problems.INVALID_HEADER, f"The value of '{shown(field)}' is not a valid header value."
        ) from None


def text_value(value: str, name: str, field: str) -> str | Header:
    """A header value as given when it is ASCII and folds within a line, else encoded words
    (RFC 2047), which split where the text cannot."""
    if value.isascii() and all(len(word) <= _LONGEST_WORD for word in value.split()):
        return value
    try:
        return Header(value, _UTF8, header_name=name)
    except (ValueError, UnicodeError):
        raise Problem(
            problems.INVALID_HEADER, f"The value of '{shown(field)}' is not a valid header value."
        ) from None


def body_of(text: str | None, html: str | None) -> Message:
    """The text, the html, or both as multipart/alternative."""
    parts = [
        _text_part(content, subtype, name)
        for content, subtype, name in ((text, "plain", "text"), (html, "html", "html"))
        if content is not None
    ]
    if len(parts) == 1:
        return parts[0]
    alternative = MIMEMultipart("alternative", policy=_WRITE)
    for part in parts:
        alternative.attach(part)
    return alternative


def _text_part(content: str, subtype: str, field: str) -> Message:
    """7bit for ASCII in lines of at most 78 characters, else UTF-8 in quoted-printable (never
    8bit, which a destination without 8BITMIME cannot take)."""
    if not content.endswith("\n"):
        content += "\n"  # a part's text ends with its line, not with the boundary's CRLF
    plain = content.isascii() and all(len(line) <= _LINE for line in content.splitlines())
    if plain:
        return MIMEText(content, subtype, "us-ascii", policy=_WRITE)
    part = MIMENonMultipart("text", subtype, policy=_WRITE, charset="utf-8")
    try:
        part.set_payload(content, _UTF8)
        return part
    except (ValueError, UnicodeError):
        raise Problem(
            problems.INVALID_FIELD, f"The field '{field}' cannot be encoded as UTF-8."
        ) from None


@dataclass(frozen=True)
class Attachment:
    filename: str
    content_type: str  # "type/subtype"
    parameters: tuple[tuple[str, str], ...]  # of the content type
    content: bytes
    # Set: an inline part the html names as "cid:<content_id>" (multipart/related, RFC 2387).
    content_id: str | None = None


def with_attachments(body: Message, attachments: list[Attachment]) -> Message:
    """`body` with its inline parts in multipart/related, then the other attachments in
    multipart/mixed."""
    inline = [a for a in attachments if a.content_id is not None]
    if inline:
        related = MIMEMultipart("related", policy=_WRITE)
        related.attach(body)
        for attachment in inline:
            related.attach(_part(attachment, "inline"))
        body = related
    rest = [a for a in attachments if a.content_id is None]
    if not rest:
        return body
    mixed = MIMEMultipart("mixed", policy=_WRITE)
    mixed.attach(body)
    for attachment in rest:
        mixed.attach(_part(attachment, "attachment"))
    return mixed


def _part(attachment: Attachment, disposition: str) -> Message:
    maintype, subtype = attachment.content_type.split("/")
    part = MIMEBase(maintype, subtype, policy=_WRITE)
    for name, value in attachment.parameters:
        part.set_param(name, value)
    part.set_payload(attachment.content)
    encoders.encode_base64(part)
    filename = attachment.filename
    if filename.isascii() and len(filename) <= _SHORT_FILENAME:
        part.add_header("Content-Disposition", disposition, filename=filename)
    else:
        part["Content-Disposition"] = _disposition(filename, disposition)
    if attachment.content_id is not None:
        part["Content-ID"] = f"<{attachment.content_id}>"
    return part


def _disposition(filename: str, disposition: str = "attachment") -> str:
    """`attachment` with the filename in RFC 2231 continuations (`filename*0*=utf-8''...;
    filename*1*=...`), each short, so that the field folds between them: a long filename written
    whole made a line of 20,000 octets (RFC 5322 2.1.1 allows 998)."""
    encoded = urllib.parse.quote(filename.encode("utf-8"), safe=_ATTR_CHARS)
    chunks: list[str] = []
    start = 0
    while start < len(encoded):
        end = min(start + _SHORT_FILENAME, len(encoded))
        cut = encoded.rfind("%", max(start, end - 2), end)  # never inside a %XX
        if cut > start and end < len(encoded):
            end = cut
        chunks.append(encoded[start:end])
        start = end
    charset = "utf-8''"  # RFC 2231 4: charset'language' on the first part only
    parts = [f"filename*{i}*={charset if i == 0 else ''}{c}" for i, c in enumerate(chunks)]
    return f"{disposition}; " + "; ".join(parts)


def flatten(headers: list[tuple[str, str | Header]], body: Message) -> bytes:
    """The message: the request's fields first, then the MIME ones, CRLF line ends."""
    for part in body.walk():
        if part is not body:
            del part["MIME-Version"]  # the top level says it once
    mime = [(name, body[name]) for name in _MIME_FIELDS if name in body]
    for name, _value in mime:
        del body[name]
    for name, value in [*headers, *mime]:
        body[name] = value  # type: ignore[assignment]  # compat32 takes a Header as well
    try:
        return body.as_bytes(policy=_WRITE)
    except (ValueError, TypeError, UnicodeError, email.errors.MessageError) as exc:
        raise Problem(
            problems.INVALID_HEADER, f"The message cannot be built from these fields: {exc}."
        ) from None
