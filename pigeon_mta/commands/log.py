"""`log REF`: the whole story of a message, found by queue id, Message-ID or recipient address."""

from __future__ import annotations

import argparse
import heapq
from datetime import UTC, datetime, timedelta
from typing import Any

from pigeon_mta.commands.common import CliError, add_common, format_age, open_database, print_rows
from pigeon_mta.delivery_records import story_records, to_json_line
from pigeon_mta.logs import printable
from pigeon_mta.model import EVENT_TYPE, Outcome, message_kind
from pigeon_mta.store import events as store_events
from pigeon_mta.store.duplicates import DuplicateRecord
from pigeon_mta.store.events import AttemptRecord, MessageStory, RecipientRecord
from pigeon_mta.store.feedback import RecordedEvent as FeedbackEvent

DEFAULT_LIMIT = 10


def register(sub: Any) -> None:
    p = sub.add_parser(
        "log",
        help="where is a message, and why: its reception, every attempt, its state now",
        description="REF is a queue id, a Message-ID header value (with or without <>), or a "
        "recipient address (its newest messages).",
    )
    add_common(p)
    p.add_argument("ref", metavar="REF", help="queue id, Message-ID or recipient address")
    p.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N messages for an address or Message-ID (newest; default {DEFAULT_LIMIT})",
    )
    p.set_defaults(handler=cmd_log)


async def cmd_log(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise CliError("--limit must be at least 1")
    async with open_database(args) as (_settings, conn):
        lookup = await store_events.find_stories(conn, args.ref, limit=args.limit)
    if lookup is None:
        raise CliError(
            f"no message matches {args.ref!r} (looked for a queue id, a Message-ID and a "
            "recipient address)"
        )
    if args.json:
        # JSON lines with the delivery log's fields, exactly as the delivery log writes them.
        for story in lookup.stories:
            for record in story_records(story):
                print(to_json_line(record))
        return 0
    now = datetime.now(UTC)
    if len(lookup.stories) > 1:
        print(f"{len(lookup.stories)} messages found by {lookup.found_by}, oldest first\n")
    for i, story in enumerate(lookup.stories):
        if i:
            print()
        print_story(story, now)
    return 0


# ---------------------------------------------------------------- the readable story


def print_story(story: MessageStory, now: datetime) -> None:
    m = story.message
    print(f"Message {m.id}")
    details = {
        "Message-ID": f"<{m.header_message_id}>" if m.header_message_id else "(none)",
        "org": m.org_name,
        "from": m.sender or "<> (null sender)",
        "kind": "a delivery status notification (DSN) pigeon-mta made for mail that failed"
        if message_kind(m.listener) == "dsn"
        else "message",
        "received": _reception(story),
        "recipients": ", ".join(r.address for r in story.recipients) or "(none)",
    }
    if m.send_at is not None:
        details["scheduled"] = f"not attempted before {_time(m.send_at)} UTC (send_at)"
    if m.expires_at is not None:
        details["deadline"] = f"no attempt after {_time(m.expires_at)} UTC (expires_at)"
    if m.order_key is not None:
        details["order key"] = (
            f"{m.order_key} (each recipient gets it after the org's earlier mail of the key)"
        )
    if m.metadata:
        details["metadata"] = ", ".join(f"{k}={v}" for k, v in sorted(m.metadata.items()))
    if m.reuses is not None:
        details["duplicate?"] = (
            f"no: message {m.reuses} has the same Message-ID and other content, within "
            "limits.duplicate_window; this one was queued as a message of its own"
        )
    width = max(len(k) for k in details)
    for key, value in details.items():
        print(f"  {key.ljust(width)}  {printable(value, newlines=True)}")
    print()
    print_rows(argparse.Namespace(json=False), _timeline(story), _COLUMNS)
    print()
    print("Now")
    width = max((len(r.address) for r in story.recipients), default=0)
    for r in story.recipients:
        print(f"  {r.address.ljust(width)}  {printable(state_text(r, now), newlines=True)}")


def _reception(story: MessageStory) -> str:
    m = story.message
    parts = [f"{_time(m.received_at)} UTC on listener {m.listener}"]
    if m.client_ip:
        parts.append(f"from {m.client_ip}" + (f" (HELO {m.client_helo})" if m.client_helo else ""))
    parts.append(f"authenticated as {m.auth_user}" if m.auth_user else "without AUTH")
    parts.append(f"{m.size} bytes")
    parts.append(f"lane={m.lane}")
    return ", ".join(parts)


# `dkim`: how the message an attempt sent was signed, or why it went unsigned (signer.py).
_COLUMNS = ["time", "event", "recipient", "attempt", "mx", "ip", "tls", "dkim", "reply"]


def _timeline(story: MessageStory) -> list[dict[str, Any]]:
    m = story.message
    count = len(story.recipients)
    rows: list[dict[str, Any]] = [
        {
            "time": _time(m.received_at),
            "event": "Reception",
            "recipient": story.recipients[0].address if count == 1 else f"{count} recipients",
            "ip": m.client_ip,
            "tls": m.tls_version,
            "reply": f"250 2.0.0 Ok: queued as {m.id}",
        }
    ]
    addresses = {r.id: r.address for r in story.recipients}
    attempts = [_attempt_row(story, a, addresses.get(a.recipient_id, "?")) for a in story.attempts]
    duplicates = [_duplicate_row(d) for d in story.duplicates]
    feedback = [_feedback_row(f) for f in story.feedback]
    # Each list is in time order already; the times are text of one width.
    rows.extend(heapq.merge(attempts, duplicates, feedback, key=lambda row: str(row["time"])))
    return rows


def _feedback_row(f: FeedbackEvent) -> dict[str, Any]:
    """What a bounce arriving later or a complaint report said (feedback/)."""
    if f.kind == "complaint":
        event = f"Complaint ({f.feedback_type or 'abuse'})"
    elif f.kind == "bounce" and f.hard:
        event = "Bounce (async)"
    else:
        event = "TransientFailure (async)"
    reply = " ".join(str(p) for p in (f.code, f.enhanced_code, f.response) if p)
    if f.changed_state:
        reply += "; delivered -> bounced"
    return {
        "time": _time(f.recorded_at),
        "event": event,
        "recipient": f.address,
        "reply": f"{reply}; feedback {f.feedback_id}".replace("\r", "").replace("\n", " / "),
    }


def _duplicate_row(d: DuplicateRecord) -> dict[str, Any]:
    """A later submission of the same Message-ID that named this recipient again."""
    return {
        "time": _time(d.received_at),
        "event": "Duplicate",
        "recipient": d.address,
        "ip": d.client_ip,
        "tls": d.tls_version,
        "reply": f"250 2.0.0 Ok: queued as {d.reply_id}; already queued here, not queued again",
    }


def _attempt_row(story: MessageStory, a: AttemptRecord, address: str) -> dict[str, Any]:
    reply = " ".join(str(p) for p in (a.code, a.enhanced_code, a.response) if p)
    if not a.applied:
        reply += " [recorded after the lease ended: possible duplicate]"
    if a.id in story.dsns:
        reply += f"; DSN queued as {story.dsns[a.id]}"
    if a.id in story.suppressed:
        reply += f"; suppressed {story.suppressed[a.id]}"
    shaped = (a.rule or "").partition("; shaping ")[2] or (a.rule or "").partition("shaping ")[2]
    if shaped:
        reply += f"; reply rule {shaped}"
    return {
        "time": _time(a.started_at + timedelta(seconds=a.duration)),  # as the delivery log
        "event": EVENT_TYPE[Outcome(a.outcome)],
        "recipient": address,
        "attempt": a.attempt,
        "mx": f"{a.mx_host}:{a.port}" if a.mx_host and a.port else a.mx_host,
        "ip": a.ip,
        "tls": a.tls_version,
        "dkim": a.dkim,
        "reply": reply.replace("\r", "").replace("\n", " / ") or None,
    }


def state_text(r: RecipientRecord, now: datetime) -> str:
    """Where a recipient is now, in words."""
    tries = f"{r.attempts} attempt{'s' if r.attempts != 1 else ''}"
    last = " ".join(str(p) for p in (r.last_code, r.last_enhanced_code, r.last_response) if p)
    last = f"; last reply: {last}" if last else ""
    if r.status == "queued":
        when = (
            "due now"
            if r.next_attempt_at <= now
            else f"next attempt {_time(r.next_attempt_at)} UTC "
            f"(in {format_age((r.next_attempt_at - now).total_seconds())})"
        )
        waits = f"; {r.postponed}" if r.postponed else ""
        if r.attempts == 0:
            return f"queued, not tried yet; {when}{waits}"
        return f"deferred after {tries}; {when}{waits}{last}"
    if r.status == "delivering":
        return f"being delivered now (attempt {r.attempts})"
    if r.status == "delivered":
        return f"delivered after {tries}{last}"
    return f"{r.status} after {tries} at {_time(r.updated_at)} UTC{last}"


def _time(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
