"""Delivery status notifications (RFC 3464 bounces and delay warnings), built as pure values.

A DSN goes from MAILER-DAEMON@<server.hostname> with the null envelope sender (RFC 5321 section
4.5.5), so that a DSN that cannot be delivered is never answered by another one; mail that itself
came from the null sender gets no DSN at all. One DSN names every recipient that failed in one
round, and carries the original's header section (text/rfc822-headers), not its body.

The message is assembled by hand rather than through the email package: every byte of it is then
visibly ours (CRLF line ends, folded fields, 7-bit delivery-status part), and text that came from a
remote server cannot break out of the field it was put in. What came from outside is made fit for
its field, never refused: a reply's text becomes plain ASCII (plain.py) in the delivery-status
fields and is folded or cut to lines of at most 998 octets (RFC 5322 2.1.1); a status that is not
a well-formed enhanced code gives way to the generic one; an address beyond ASCII (SMTPUTF8) is
written as RFC 6533's `utf-8` address type in its 7-bit xtext form in the delivery status, and as
UTF-8 (RFC 6532) in the To: field, which only an SMTPUTF8 path can carry to it anyway.
"""

from __future__ import annotations

import email.utils
import re
import textwrap
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pigeon_mta.ids import new_id
from pigeon_mta.message import split_at_blank_line
from pigeon_mta.model import DSN_LISTENER, Envelope, Reply
from pigeon_mta.plain import is_enhanced_code, plain_text

EXPIRED_STATUS = "4.4.7"  # RFC 3463: delivery time expired
MAX_ORIGINAL_HEADER_BYTES = 64 * 1024
_FOLD_AT = 78
# The longest run of a field's value without a space: a longer word is broken there, so that no
# line passes RFC 5322's 998 octets.
_LONGEST_WORD = 900
# How much of a reply a DSN repeats, in the human part and in Diagnostic-Code.
MAX_REPLY_CHARS = 4000

Action = Literal["failed", "delayed"]


@dataclass(frozen=True)
class OriginalMessage:
    """The queued message a DSN reports on."""

    queue_id: uuid.UUID
    org_id: uuid.UUID
    sender: str  # the envelope sender; "" means the message was itself a DSN
    received_at: datetime
    header_message_id: str | None
    headers: bytes  # its header section, as received


@dataclass(frozen=True)
class RecipientReport:
    """What happened to one recipient, as the DSN tells it."""

    address: str
    reply: Reply | None  # the last reply (or local failure) for this recipient, if any
    remote_mta: str | None = None  # the host that gave the reply
    status: str | None = None  # the DSN status; derived from the reply when not given
    last_attempt_at: datetime | None = None


def header_section(body: bytes, limit: int = MAX_ORIGINAL_HEADER_BYTES) -> bytes:
    """The header section of a raw message (everything before the first empty line), at most
    `limit` bytes of it."""
    headers, _body = split_at_blank_line(body)
    if len(headers) > limit:
        # Cut at a line end so that no header is left half-written.
        headers = headers[: headers.rfind(b"\n", 0, limit) + 1 or limit]
    return headers


def build_bounce(
    original: OriginalMessage,
    failed: Sequence[RecipientReport],
    *,
    hostname: str,
    now: datetime | None = None,
) -> Envelope | None:
    """The DSN (Action: failed) for recipients that bounced or expired; None when none is due."""
    if not original.sender or not failed:
        return None
    reports: list[tuple[RecipientReport, Action, str]] = [
        (r, "failed", r.status or final_status(r.reply)) for r in failed
    ]
    lines = [
        f"This is the mail system at {hostname}.",
        "",
        "Your message could not be delivered to the recipients below. This is final: the",
        "mail system will not try again. The delivery report and the headers of your",
        "message are attached.",
        "",
    ]
    for report, _action, status in reports:
        lines.extend(_explain(report, status))
    lines.extend(_about(original))
    return _dsn(
        original,
        reports,
        hostname=hostname,
        subject="Undelivered mail returned to sender",
        human="\r\n".join(lines),
        now=now,
    )


def build_delay_warning(
    original: OriginalMessage,
    delayed: Sequence[RecipientReport],
    *,
    hostname: str,
    retry_until: datetime,
    now: datetime | None = None,
) -> Envelope | None:
    """A warning (Action: delayed) that delivery is still being retried; None when none is due."""
    if not original.sender or not delayed:
        return None
    reports: list[tuple[RecipientReport, Action, str]] = [
        (r, "delayed", r.status or delayed_status(r.reply)) for r in delayed
    ]
    until = retry_until.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"This is the mail system at {hostname}.",
        "",
        "This is a warning only: you do not need to send your message again. It has not",
        f"been delivered yet to the recipients below; delivery will be tried until {until}.",
        "",
    ]
    for report, _action, status in reports:
        lines.extend(_explain(report, status))
    lines.extend(_about(original))
    return _dsn(
        original,
        reports,
        hostname=hostname,
        subject="Delayed mail (still being retried)",
        human="\r\n".join(lines),
        now=now,
        retry_until=retry_until,
    )


def final_status(reply: Reply | None) -> str:
    """The DSN status of a permanent failure: the reply's 5.x.x code, else 5.0.0."""
    return _status_of(reply, "5") or "5.0.0"


def delayed_status(reply: Reply | None) -> str:
    return _status_of(reply, "4") or "4.0.0"


def _status_of(reply: Reply | None, klass: str) -> str | None:
    """The reply's enhanced code when it is well-formed and of class `klass` (a code stored
    before codes were read as ASCII digits may not be)."""
    if reply is None or not is_enhanced_code(reply.enhanced_code):
        return None
    code = str(reply.enhanced_code)
    return code if code.startswith(f"{klass}.") else None


# ---------------------------------------------------------------- assembly


def _dsn(
    original: OriginalMessage,
    reports: Sequence[tuple[RecipientReport, Action, str]],
    *,
    hostname: str,
    subject: str,
    human: str,
    now: datetime | None,
    retry_until: datetime | None = None,
) -> Envelope:
    now = now or datetime.now(UTC)
    message_id = f"{new_id()}@{hostname}"
    boundary = f"=_pigeon_{uuid.uuid4().hex}"
    head = [
        _field("From", f"Mail Delivery System <MAILER-DAEMON@{hostname}>"),
        _field("To", f"<{_one_line(original.sender)}>", utf8=True),
        _field("Subject", subject),
        _field("Date", email.utils.format_datetime(now.astimezone(UTC))),
        _field("Message-ID", f"<{message_id}>"),
    ]
    original_id = _message_id(original.header_message_id)
    if original_id:
        head.append(_field("In-Reply-To", original_id))
        head.append(_field("References", original_id))
    head += [
        # RFC 3834: automatic replies must not be answered automatically.
        _field("Auto-Submitted", "auto-replied"),
        _field("MIME-Version", "1.0"),
        _field(
            "Content-Type",
            f'multipart/report; report-type=delivery-status; boundary="{boundary}"',
        ),
    ]
    human_bytes = _wrap(human).encode("utf-8", "replace")
    status = _delivery_status(original, reports, hostname=hostname, retry_until=retry_until)
    headers = _crlf(original.headers).rstrip(b"\r\n") + b"\r\n"
    parts = [
        _part(
            "text/plain; charset=utf-8",
            human_bytes,
            description="Notification",
        ),
        _part("message/delivery-status", status, description="Delivery report"),
        _part("text/rfc822-headers", headers, description="Undelivered message headers"),
    ]
    # ASCII but for an SMTPUTF8 sender in To: (RFC 6532).
    body = b"".join(line.encode("utf-8") for line in head)
    body += b"\r\nThis is a MIME-encapsulated delivery status notification.\r\n"
    for part in parts:
        body += f"\r\n--{boundary}\r\n".encode("ascii") + part
    body += f"\r\n--{boundary}--\r\n".encode("ascii")
    return Envelope(
        org_id=original.org_id,
        sender="",
        recipients=(original.sender,),
        body=body,
        listener=DSN_LISTENER,
        header_message_id=message_id,
    )


def _delivery_status(
    original: OriginalMessage,
    reports: Sequence[tuple[RecipientReport, Action, str]],
    *,
    hostname: str,
    retry_until: datetime | None,
) -> bytes:
    """The message/delivery-status body: one per-message block, then one block per recipient."""
    blocks = [
        [
            _field("Reporting-MTA", f"dns; {hostname}"),
            _field("X-Pigeon-Queue-ID", str(original.queue_id)),
            _field("Arrival-Date", _date(original.received_at)),
        ]
    ]
    for report, action, status in reports:
        block = [
            _field("Final-Recipient", _address_type(report.address)),
            _field("Action", action),
            _field("Status", status if is_enhanced_code(status) else f"{status[:1]}.0.0"),
        ]
        if report.remote_mta:
            block.append(_field("Remote-MTA", f"dns; {report.remote_mta}"))
        diagnostic = _diagnostic(report.reply)
        if diagnostic:
            block.append(_field("Diagnostic-Code", diagnostic))
        if report.last_attempt_at is not None:
            block.append(_field("Last-Attempt-Date", _date(report.last_attempt_at)))
        if retry_until is not None:
            block.append(_field("Will-Retry-Until", _date(retry_until)))
        blocks.append(block)
    return "\r\n".join("".join(block) for block in blocks).encode("ascii")


def _diagnostic(reply: Reply | None) -> str | None:
    """`smtp; <reply>` for what a server said; a local failure gets an X- type (RFC 3464 2.3.6)."""
    if reply is None or not (reply.code or reply.text):
        return None
    kind = "smtp" if reply.code else "X-Pigeon"
    return f"{kind}; {plain_text(str(reply), MAX_REPLY_CHARS)}"


def _explain(report: RecipientReport, status: str) -> list[str]:
    if status == EXPIRED_STATUS:
        why = "Delivery did not succeed before the message's time in the queue ran out."
        if report.reply is not None:
            why += f" The last attempt ended with: {_reply_line(report.reply)}"
    elif report.reply is None:
        why = f"Status {_one_line(status)}."
    elif report.reply.code and report.remote_mta:
        why = f"The server {_one_line(report.remote_mta)} answered: {_reply_line(report.reply)}"
    elif report.reply.code:
        why = f"The receiving server answered: {_reply_line(report.reply)}"
    else:
        why = _reply_line(report.reply)
    return [
        f"<{_one_line(report.address)}>",
        *textwrap.wrap(why, 72, initial_indent="    ", subsequent_indent="    "),
        "",
    ]


def _about(original: OriginalMessage) -> list[str]:
    lines = [f"Your message: queue id {original.queue_id}, received {_date(original.received_at)}"]
    if original.header_message_id:
        lines.append(f"Message-ID: <{_one_line(original.header_message_id)}>")
    return lines


def _part(content_type: str, payload: bytes, *, description: str) -> bytes:
    encoding = "7bit" if payload.isascii() else "8bit"
    head = (
        f"Content-Type: {content_type}\r\n"
        f"Content-Description: {description}\r\n"
        f"Content-Transfer-Encoding: {encoding}\r\n\r\n"
    )
    return head.encode("ascii") + payload


# ---------------------------------------------------------------- text hygiene

_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def _one_line(text: str) -> str:
    """Text from outside (a reply, an address) made safe for one field: no line breaks."""
    return " ".join(_CONTROL.sub(" ", text).split())


def _reply_line(reply: Reply) -> str:
    """A reply for the human part: one line, no longer than MAX_REPLY_CHARS."""
    text = _one_line(str(reply))
    return text if len(text) <= MAX_REPLY_CHARS else text[: MAX_REPLY_CHARS - 3] + "..."


# RFC 6533 section 3: utf-8-addr-xtext keeps printable ASCII but for SP, "\", "+" and "=".
_XTEXT_PLAIN = frozenset(chr(c) for c in range(0x21, 0x7F)) - {"\\", "+", "="}


def _address_type(address: str) -> str:
    """An address as the value of Final-Recipient: `rfc822; addr` for an ASCII address (RFC
    3464 2.3.2), else RFC 6533's `utf-8; ` with every character beyond printable ASCII (and
    backslash, plus and equals) as backslash-x{HEX}: the 7-bit form (utf-8-addr-xtext) that
    message/delivery-status asks for."""
    address = _one_line(address)
    if address.isascii():
        return f"rfc822; {address}"
    xtext = "".join(c if c in _XTEXT_PLAIN else f"\\x{{{ord(c):02X}}}" for c in address)
    return f"utf-8; {xtext}"


def _message_id(value: str | None) -> str | None:
    if not value:
        return None
    cleaned = _one_line(value).strip("<>")
    if not cleaned or " " in cleaned or not cleaned.isascii():
        return None
    return f"<{cleaned}>"


def _field(name: str, value: str, *, utf8: bool = False) -> str:
    """`Name: value` + CRLF, folded at spaces to stay near 78 columns (RFC 5322 2.2.3); a word
    longer than _LONGEST_WORD is broken with a space. The value is plain ASCII (plain.py) unless
    `utf8` lets it be UTF-8 (RFC 6532)."""
    if utf8:
        value = _one_line(value).encode("utf-8", "replace").decode("utf-8")
    else:
        value = plain_text(value, None)
    words = [
        word[i : i + _LONGEST_WORD]
        for word in value.split(" ")
        for i in range(0, max(1, len(word)), _LONGEST_WORD)
    ]
    lines: list[str] = []
    line = f"{name}:"
    for word in words:
        if len(line) + 1 + len(word) > _FOLD_AT and line.strip() and line != f"{name}:":
            lines.append(line)
            line = " " + word
        else:
            line += " " + word
    lines.append(line)
    return "\r\n".join(lines) + "\r\n"


# Characters of a wrapped line of the human part: UTF-8 takes at most 4 octets a character, so a
# line of this many is within RFC 5322's 998 octets whatever the text.
_WRAP_AT = 240


def _wrap(text: str) -> str:
    """Human text as CRLF lines no longer than 998 octets (RFC 5322 2.1.1)."""
    out: list[str] = []
    for line in text.split("\r\n"):
        out.extend(textwrap.wrap(line, _WRAP_AT, break_long_words=True) or [""])
    return "\r\n".join(out) + "\r\n"


def _crlf(data: bytes) -> bytes:
    return re.sub(rb"\r?\n", b"\r\n", data)


def _date(value: datetime) -> str:
    return email.utils.format_datetime(value.astimezone(UTC))
