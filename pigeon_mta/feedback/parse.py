"""What a feedback message says: a delivery status notification (RFC 3464), a complaint report
(ARF, RFC 5965), a bounce in one of the non-standard formats that mail systems still send, or
nothing pigeon understands. Pure: `read_report(bytes)` returns a `Report`; matching its items to
recipients and applying them is feedback/apply.py's.

- A multipart/report with report-type=delivery-status: each per-recipient block whose Action is
  `failed` is a bounce (`hard` unless its category is a full mailbox, outbound/categories.py),
  `delayed` a delay (recorded, changes nothing); `delivered`, `relayed` and `expanded` say
  nothing to act on. The code comes from Diagnostic-Code (`smtp; 550 5.1.1 ...`), the enhanced
  code from Status.
- A multipart/report with report-type=feedback-report: a complaint of its Feedback-Type (`abuse`,
  `fraud`, `virus`, `other`, ...; `not-spam` is not a complaint), about Original-Rcpt-To or, when
  the provider left that out, the original's To:.
- Anything else: Mailman's flufl.bounce detectors, which know the formats of Exim, Postfix,
  qmail, Exchange, Yahoo and others; they name addresses (permanent or temporary), no codes.
The original message (message/rfc822 or text/rfc822-headers, the third part of a report) gives
the Message-ID to match by and its Return-Path, which holds pigeon's token.
"""

from __future__ import annotations

import dataclasses
import email
import email.message
import email.policy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from email.parser import HeaderParser
from email.utils import getaddresses
from typing import Literal

from flufl.bounce import all_failures

from pigeon_mta.model import Reply
from pigeon_mta.outbound.categories import Category
from pigeon_mta.outbound.classify import classify_reply, split_enhanced_code
from pigeon_mta.plain import plain_text

Kind = Literal["bounce", "delay", "complaint"]

# What a report's texts are cut to when stored (a hostile report's 1 MB diagnostic is not kept).
MAX_TEXT = 1000
# Parts of a report looked at, at most: a report has three; a hostile one nests thousands.
MAX_PARTS = 200
# Feedback-Type values (RFC 5965 section 7.3, IANA) that are complaints about the mail.
COMPLAINT_TYPES = frozenset({"abuse", "fraud", "virus", "other", "opt-out", "unsubscribe"})
_DIAGNOSTIC = re.compile(r"^\s*smtp\s*;\s*([245][0-9][0-9])[ \t-]*(.*)$", re.IGNORECASE | re.DOTALL)
_STATUS = re.compile(r"^\s*([245]\.[0-9]{1,3}\.[0-9]{1,3})\b")
# Enough of a "Message-ID:" line of embedded original headers in a non-standard bounce's text.
_EMBEDDED_MESSAGE_ID = re.compile(rb"^Message-ID:[ \t]*<([^<>\r\n]{1,250})>", re.IGNORECASE | re.M)


@dataclass(frozen=True)
class Item:
    """What a report says of one recipient."""

    kind: Kind
    address: str | None  # as the report names it (Final-Recipient, Original-Rcpt-To, ...)
    hard: bool  # a bounce that changes the recipient's state; a complaint is always hard
    code: int | None = None
    enhanced_code: str | None = None
    text: str = ""
    category: str | None = None
    feedback_type: str | None = None  # a complaint's Feedback-Type
    original_recipient: str | None = None  # a DSN's Original-Recipient


@dataclass(frozen=True)
class Report:
    kind: Kind | None  # None: not understood
    items: tuple[Item, ...] = ()
    # Of the original message: its Message-ID (without <>), its Return-Path / envelope sender.
    original_message_id: str | None = None
    original_senders: tuple[str, ...] = ()
    # Why it was not understood, or what was found ("DSN, 1 failed recipient").
    detail: str = ""
    own_message_id: str | None = None  # the report's own Message-ID (it is stored once by it)


def read_report(data: bytes) -> Report:
    """The report in a feedback message, never an exception: what cannot be read is a Report of
    kind None with the reason."""
    try:
        message = email.message_from_bytes(data, policy=email.policy.compat32)
    except Exception as exc:  # the parser is lenient; a hostile message may still trip it
        return Report(None, detail=f"unreadable: {type(exc).__name__}")
    own = _message_id(message.get("Message-ID"))
    try:
        report = _read(message, data)
    except RecursionError:
        report = Report(None, detail="unreadable: nested too deeply")
    except Exception as exc:
        report = Report(
            None, detail=f"unreadable: {type(exc).__name__}: {plain_text(str(exc))[:200]}"
        )
    return dataclasses.replace(report, own_message_id=own)


def _read(message: Message, data: bytes) -> Report:
    if message.get_content_type() == "multipart/report":
        report_type = str(message.get_param("report-type") or "").lower()
        if report_type == "delivery-status":
            return _dsn(message)
        if report_type == "feedback-report":
            return _arf(message)
    return _non_standard(message, data)


# ---------------------------------------------------------------- RFC 3464


def _dsn(message: Message) -> Report:
    status_part = _part(message, "message/delivery-status")
    if status_part is None:
        return Report(None, detail="a delivery-status report without its message/delivery-status")
    blocks = _status_blocks(status_part)
    items: list[Item] = []
    for block in blocks[1:]:  # the first block is about the message, the rest per recipient
        action = (block.get("Action") or "").strip().lower()
        if action not in ("failed", "delayed"):
            continue
        items.append(_dsn_item(block, "bounce" if action == "failed" else "delay"))
    original_id, senders = _original(message)
    if not items:
        return Report(None, (), original_id, senders, "a DSN that reports no failed recipient")
    kind: Kind = "bounce" if any(i.kind == "bounce" for i in items) else "delay"
    failed = sum(1 for i in items if i.kind == "bounce")
    detail = f"DSN: {failed} failed, {len(items) - failed} delayed"
    return Report(kind, tuple(items), original_id, senders, detail)


def _status_blocks(part: Message) -> list[Message]:
    """The field blocks of a message/delivery-status part: Python's parser gives them as
    sub-messages; a part it took for text is read as blank-line-separated header blocks."""
    payload = part.get_payload()
    if isinstance(payload, list):
        return [p for p in payload if isinstance(p, Message)][:MAX_PARTS]
    text = payload if isinstance(payload, str) else ""
    blocks = re.split(r"\r?\n[ \t]*\r?\n", text.strip())
    return [HeaderParser().parsestr(b) for b in blocks[:MAX_PARTS] if b.strip()]


def _dsn_item(block: Message, kind: Kind) -> Item:
    address = _typed_address(block.get("Final-Recipient"))
    original = _typed_address(block.get("Original-Recipient"))
    status = _STATUS.match(block.get("Status") or "")
    enhanced = status[1] if status else None
    code: int | None = None
    text = ""
    diagnostic = _unfold(block.get("Diagnostic-Code") or "")
    found = _DIAGNOSTIC.match(diagnostic)
    if found:
        code = int(found[1])
        in_text, text = split_enhanced_code(found[2].strip())
        enhanced = enhanced or in_text
    elif diagnostic:
        text = diagnostic.partition(";")[2].strip() or diagnostic
    text = _cut(text)
    if code is None and enhanced is not None:
        code = {"5": 550, "4": 450, "2": 250}[enhanced[0]]
    reply = Reply(code or 0, enhanced, text)
    category = classify_reply(reply).category
    hard = (
        kind == "bounce"
        and (enhanced or str(code or "5"))[0] == "5"
        and category != Category.MAILBOX_FULL
    )
    return Item(
        kind,
        address,
        hard,
        code,
        enhanced,
        text,
        str(category),
        original_recipient=original,
    )


def _typed_address(value: str | None) -> str | None:
    """The address of an `rfc822; someone@example.com` field."""
    if not value:
        return None
    address_type, _, address = _unfold(value).partition(";")
    address = (address if address else address_type).strip().strip("<>").strip()
    return _cut(address, 320) or None


# ---------------------------------------------------------------- RFC 5965


def _arf(message: Message) -> Report:
    feedback_part = _part(message, "message/feedback-report")
    if feedback_part is None:
        return Report(None, detail="a feedback report without its message/feedback-report")
    fields = _fields(feedback_part)
    feedback_type = (fields.get("Feedback-Type") or "").strip().lower()
    original_id, senders = _original(message)
    mail_from = _typed_address(fields.get("Original-Mail-From"))
    if mail_from:
        senders = (mail_from, *senders)
    if feedback_type not in COMPLAINT_TYPES:
        return Report(
            None, (), original_id, senders, f"a feedback report of type {feedback_type!r}"
        )
    addresses = [a for a in fields.get_all("Original-Rcpt-To", []) if a.strip()]
    recipients: list[str | None] = [_typed_address(a) for a in addresses]
    recipients = recipients or list(_original_recipients(message))
    text = _cut(f"complaint ({feedback_type}) from {fields.get('User-Agent') or 'a provider'}")
    items = tuple(
        Item("complaint", address, True, text=text, feedback_type=feedback_type)
        for address in (recipients or [None])
    )
    return Report("complaint", items, original_id, senders, f"ARF: {feedback_type}")


def _fields(part: Message) -> Message:
    """The fields of a message/feedback-report part (Python's parser knows no such type: its
    payload is text, or one sub-message)."""
    payload = part.get_payload()
    if isinstance(payload, list):
        first = next((p for p in payload if isinstance(p, Message)), None)
        return first if first is not None else Message()
    if isinstance(payload, bytes):
        payload = payload.decode("utf-8", "replace")
    return HeaderParser().parsestr(payload if isinstance(payload, str) else "")


def _original_recipients(message: Message) -> list[str]:
    original = _original_headers(message)
    if original is None:
        return []
    return [address for _name, address in getaddresses(original.get_all("To", []))][:10] or []


# ---------------------------------------------------------------- anything else


def _non_standard(message: Message, data: bytes) -> Report:
    try:
        temporary, permanent = all_failures(message)
    except Exception as exc:  # a detector choking on a hostile message is not a crash
        return Report(None, detail=f"no detector could read it ({type(exc).__name__})")
    items = [
        Item("bounce", _decoded(a), True, text="a bounce in a non-standard format")
        for a in sorted(permanent)
    ] + [
        Item("delay", _decoded(a), False, text="a temporary failure in a non-standard format")
        for a in sorted(temporary - permanent)
    ]
    embedded = _EMBEDDED_MESSAGE_ID.search(data)
    original_id = embedded[1].decode("utf-8", "replace") if embedded else None
    if not items:
        return Report(None, (), original_id, (), "not a bounce or complaint report")
    kind: Kind = "bounce" if permanent else "delay"
    return Report(kind, tuple(items[:MAX_PARTS]), original_id, (), "a non-standard bounce")


def _decoded(address: bytes | str) -> str:
    text = address.decode("utf-8", "replace") if isinstance(address, bytes) else address
    return _cut(text.strip().strip("<>"), 320)


# ---------------------------------------------------------------- the original message


def _original(message: Message) -> tuple[str | None, tuple[str, ...]]:
    headers = _original_headers(message)
    if headers is None:
        return None, ()
    senders = [
        address
        for value in headers.get_all("Return-Path", [])
        for _name, address in getaddresses([value])
        if address
    ]
    return _message_id(headers.get("Message-ID")), tuple(senders[:5])


def _original_headers(message: Message) -> Message | None:
    """The header of the reported message: a message/rfc822 part (the whole original) or a
    text/rfc822-headers part."""
    for part in _parts(message):
        content_type = part.get_content_type()
        if content_type == "message/rfc822":
            payload = part.get_payload()
            if isinstance(payload, list) and payload and isinstance(payload[0], Message):
                return payload[0]
        elif content_type == "text/rfc822-headers":
            raw = part.get_payload(decode=True)
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""
            return HeaderParser().parsestr(text)
    return None


def _part(message: Message, content_type: str) -> Message | None:
    return next((p for p in _parts(message) if p.get_content_type() == content_type), None)


def _parts(message: Message) -> Iterator[Message]:
    """The direct parts of a report (not the parts inside the original it quotes), bounded."""
    payload = message.get_payload()
    if not isinstance(payload, list):
        return
    for part in payload[:MAX_PARTS]:
        if isinstance(part, Message):
            yield part


def _message_id(value: str | None) -> str | None:
    if not value:
        return None
    text = _unfold(str(value)).strip()
    found = re.search(r"<([^<>]{1,250})>", text)
    return found[1] if found else (text[:250] or None)


def _unfold(value: str) -> str:
    return re.sub(r"\r?\n[ \t]+", " ", str(value))


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    return plain_text(text)[:limit]
