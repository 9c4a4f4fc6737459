"""Delivery log records built from values: one dict per event, with the contract fields first.

Events are per recipient: Reception (the message was queued), then Delivery, TransientFailure,
Bounce, Expiration or Suppressed for each attempt or final decision; Duplicate when a retried
submission named the recipient again and it was not queued again (store/duplicates.py). Every
record has the contract fields (`EVENT_FIELDS`) in that order, then a few extras. The same events are in the database (the
message row and the attempt rows); `pigeon-mta log --json` rebuilds them from there with the same
functions, so the file and the command never disagree on a field (but for free text shortened on
stdout, see delivery_log.py).
"""

from __future__ import annotations

import heapq
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pigeon_mta.model import (
    COMPLAINT_EVENT,
    EVENT_TYPE,
    AttemptResult,
    Delivery,
    Envelope,
    Outcome,
    message_kind,
)
from pigeon_mta.store.duplicates import DuplicateRecord, Duplicates
from pigeon_mta.store.events import AttemptRecord, MessageRecord, MessageStory
from pigeon_mta.store.feedback import RecordedEvent as FeedbackEvent

Record = dict[str, Any]

# The interface contract's fields, in the order every record starts with.
EVENT_FIELDS = (
    "type",
    "timestamp",
    "queue_id",
    "message_id",
    "org",
    "sender",
    "recipient",
    "mx",
    "ip",
    "code",
    "enhanced_code",
    "response",
    "tls",
    "attempt",
)

RECEPTION = "Reception"
DUPLICATE = "Duplicate"


def timestamp_text(when: datetime) -> str:
    """ISO 8601 in UTC with microseconds and a Z: 2025-01-02T03:04:05.678901Z."""
    return when.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def event_record(
    type: str,
    *,
    timestamp: datetime,
    queue_id: uuid.UUID,
    message_id: str | None,
    org: uuid.UUID,
    sender: str,
    recipient: str,
    mx: str | None = None,
    ip: str | None = None,
    code: int | None = None,
    enhanced_code: str | None = None,
    response: str | None = None,
    tls_version: str | None = None,
    tls_cipher: str | None = None,
    attempt: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Record:
    """One delivery log record: the contract fields, then `extra` (None values left out).

    `org` is the org's id (stable, unlike a name). `tls` is null for a plaintext session, else
    {"version": ..., "cipher": ...}. `code` is null when the peer said nothing (connection errors).
    """
    record: Record = {
        "type": type,
        "timestamp": timestamp_text(timestamp),
        "queue_id": str(queue_id),
        "message_id": message_id,
        "org": str(org),
        "sender": sender,
        "recipient": recipient,
        "mx": mx,
        "ip": ip,
        "code": code or None,
        "enhanced_code": enhanced_code,
        "response": response,
        "tls": {"version": tls_version, "cipher": tls_cipher}
        if tls_version or tls_cipher
        else None,
        "attempt": attempt,
    }
    for key, value in (extra or {}).items():
        if value is not None:
            record[key] = timestamp_text(value) if isinstance(value, datetime) else value
    return record


def queued_reply(queue_id: uuid.UUID) -> str:
    """The text after `250 2.0.0` that the client got (interface contract)."""
    return f"Ok: queued as {queue_id}"


def reception_records(
    queue_id: uuid.UUID, envelope: Envelope, *, received_at: datetime
) -> list[Record]:
    return [
        event_record(
            RECEPTION,
            timestamp=received_at,
            queue_id=queue_id,
            message_id=envelope.header_message_id,
            org=envelope.org_id,
            sender=envelope.sender,
            recipient=recipient,
            ip=envelope.client_ip,
            code=250,
            enhanced_code="2.0.0",
            response=queued_reply(queue_id),
            tls_version=envelope.tls_version,
            tls_cipher=envelope.tls_cipher,
            extra=_reception_extra(
                envelope.listener,
                envelope.client_helo,
                envelope.auth_user,
                len(envelope.body),
                envelope.lane,
                intent=_intent_of(envelope),
            ),
        )
        for recipient in envelope.recipients
    ]


def _reception_extra(
    listener: str,
    helo: str | None,
    auth_user: str | None,
    size: int,
    lane: str | None = None,
    *,
    intent: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`lane`: the lane the message is delivered in (None for a Duplicate, which queued
    nothing). `kind`: "dsn" for a delivery status notification pigeon-mta made, else
    "message" (model.message_kind, as the API and webhook events say). `intent`: the send
    intent's fields that are set (expires_at, send_at, order_key, metadata)."""
    return {
        "listener": listener,
        "kind": message_kind(listener),
        "helo": helo,
        "auth_user": auth_user,
        "size": size,
        "lane": lane,
        **{
            k: timestamp_text(v) if isinstance(v, datetime) else v
            for k, v in (intent or {}).items()
        },
    }


def _intent_of(m: Envelope | MessageRecord) -> dict[str, Any]:
    """The send intent's fields a message has, by their API names."""
    fields = {
        "expires_at": m.expires_at,
        "send_at": m.send_at,
        "order_key": m.order_key,
        "metadata": dict(m.metadata) if m.metadata else None,
    }
    return {name: value for name, value in fields.items() if value is not None}


def duplicate_record(d: DuplicateRecord) -> Record:
    """A recipient a submission named again and that was not queued again: `queue_id` is the
    message that holds it, `response` the reply the submission got."""
    return event_record(
        DUPLICATE,
        timestamp=d.received_at,
        queue_id=d.original_id,
        message_id=d.header_message_id,
        org=d.org_id,
        sender=d.sender,
        recipient=d.address,
        ip=d.client_ip,
        code=250,
        enhanced_code="2.0.0",
        response=queued_reply(d.reply_id),
        tls_version=d.tls_version,
        tls_cipher=d.tls_cipher,
        extra=_reception_extra(d.listener, d.client_helo, d.auth_user, d.size),
    )


def duplicate_records(
    envelope: Envelope, duplicates: Duplicates, *, received_at: datetime
) -> list[Record]:
    """The Duplicate records of a submission as it was committed, in address order, as
    `pigeon-mta log` reads them back."""
    return [
        duplicate_record(
            DuplicateRecord(
                org_id=envelope.org_id,
                original_id=original_id,
                reply_id=duplicates.reply_id,
                header_message_id=envelope.header_message_id or "",
                sender=envelope.sender,
                address=address,
                received_at=received_at,
                listener=envelope.listener,
                client_ip=envelope.client_ip,
                client_helo=envelope.client_helo,
                auth_user=envelope.auth_user,
                size=len(envelope.body),
                tls_version=envelope.tls_version,
                tls_cipher=envelope.tls_cipher,
            )
        )
        for address, original_id in sorted(duplicates.originals.items())
    ]


def attempt_records(delivery: Delivery, results: Iterable[AttemptResult]) -> list[Record]:
    addresses = {r.id: r.address for r in delivery.recipients}
    return [
        event_record(
            EVENT_TYPE[result.outcome],
            timestamp=result.started_at + timedelta(seconds=result.duration),
            queue_id=delivery.queue_id,
            message_id=delivery.header_message_id,
            org=delivery.org_id,
            sender=delivery.sender,
            recipient=addresses.get(result.recipient_id, ""),
            mx=result.mx_host,
            ip=result.ip,
            code=result.reply.code,
            enhanced_code=result.reply.enhanced_code,
            response=result.reply.text,
            tls_version=result.tls_version,
            tls_cipher=result.tls_cipher,
            attempt=result.attempt,
            extra=_attempt_extra(
                result.port,
                result.duration,
                result.next_attempt_at if result.outcome == Outcome.DEFERRED else None,
                result.category,
                result.dkim,
                delivery.lane,
            ),
        )
        for result in results
    ]


def _attempt_extra(
    port: int | None,
    duration: float,
    next_attempt_at: datetime | None,
    category: str | None,
    dkim: str | None,
    lane: str,
) -> dict[str, Any]:
    """`dkim`: "signed d=DOMAIN s=SELECTOR" or "unsigned: REASON" for an attempt that sent the
    message (signer.py), left out otherwise. `lane`: the message's lane."""
    return {
        "port": port,
        "duration": round(duration, 6),
        "next_attempt_at": next_attempt_at,
        "category": category,
        "dkim": dkim,
        "lane": lane,
    }


def story_records(story: MessageStory) -> list[Record]:
    """The records of a story read from the database: Receptions, then attempts in order, with
    the Duplicates among them by time."""
    m = story.message
    records = [
        event_record(
            RECEPTION,
            timestamp=m.received_at,
            queue_id=m.id,
            message_id=m.header_message_id,
            org=m.org_id,
            sender=m.sender,
            recipient=r.address,
            ip=m.client_ip,
            code=250,
            enhanced_code="2.0.0",
            response=queued_reply(m.id),
            tls_version=m.tls_version,
            tls_cipher=m.tls_cipher,
            extra=_reception_extra(
                m.listener, m.client_helo, m.auth_user, m.size, m.lane, intent=_intent_of(m)
            ),
        )
        for r in story.recipients
    ]
    addresses = {r.id: r.address for r in story.recipients}
    attempts = [
        _stored_attempt_record(story, a, addresses.get(a.recipient_id, "")) for a in story.attempts
    ]
    duplicates = [duplicate_record(d) for d in story.duplicates]
    feedback = [feedback_record(m.header_message_id, m.sender, f) for f in story.feedback]
    # Timestamps are ISO 8601 in UTC of one width: their text sorts as time does.
    records.extend(heapq.merge(attempts, duplicates, feedback, key=lambda r: str(r["timestamp"])))
    return records


# What a feedback event is in the log: a hard async bounce a Bounce, a soft one or a delay a
# TransientFailure, a complaint a Complaint; each marked "async" (`pigeon-mta log` shows
# "Bounce (async)").


def feedback_record(header_message_id: str | None, sender: str, f: FeedbackEvent) -> Record:
    if f.kind == "complaint":
        kind = COMPLAINT_EVENT
    else:
        kind = EVENT_TYPE[Outcome.BOUNCED if f.kind == "bounce" and f.hard else Outcome.DEFERRED]
    return event_record(
        kind,
        timestamp=f.recorded_at,
        queue_id=f.queue_id,
        message_id=header_message_id,
        org=f.org_id,
        sender=sender,
        recipient=f.address,
        code=f.code,
        enhanced_code=f.enhanced_code,
        response=f.response,
        extra={
            "async": True,
            "category": f.category,
            "feedback_type": f.feedback_type,
            "feedback_id": str(f.feedback_id),
            "changed_state": f.changed_state,
        },
    )


def _stored_attempt_record(story: MessageStory, a: AttemptRecord, address: str) -> Record:
    m = story.message
    return event_record(
        EVENT_TYPE[Outcome(a.outcome)],
        timestamp=a.started_at + timedelta(seconds=a.duration),
        queue_id=m.id,
        message_id=m.header_message_id,
        org=m.org_id,
        sender=m.sender,
        recipient=address,
        mx=a.mx_host,
        ip=a.ip,
        code=a.code,
        enhanced_code=a.enhanced_code,
        response=a.response,
        tls_version=a.tls_version,
        tls_cipher=a.tls_cipher,
        attempt=a.attempt,
        extra={
            **_attempt_extra(
                a.port,
                a.duration,
                a.next_attempt_at if a.outcome == Outcome.DEFERRED else None,
                a.category,
                a.dkim,
                m.lane,
            ),
            # What the failure caused, known once its transaction committed: only in records
            # rebuilt from the database (`pigeon-mta log`).
            "dsn_queue_id": str(story.dsns[a.id]) if a.id in story.dsns else None,
            "suppressed": story.suppressed.get(a.id),
        },
    )


def to_json_line(record: Record) -> str:
    """One record as one line of JSON. json escapes CR and LF; the characters that other readers
    also end a line at (NEL U+0085, LINE and PARAGRAPH SEPARATOR U+2028/9: Python's splitlines,
    JavaScript before ES2019) are escaped here, so that a remote reply holding one cannot cut a
    record in two for them."""
    line = _ENCODER.encode(record)
    if _LINE_BREAKS.search(line):
        line = _LINE_BREAKS.sub(lambda m: f"\\u{ord(m[0]):04x}", line)
    return line


# Outside JSON strings they cannot occur, so replacing them anywhere escapes them where they are.
_LINE_BREAKS = re.compile("[\u0085\u2028\u2029]")


# One encoder for every record: json.dumps with options builds a new one per call (2 us of 5).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
