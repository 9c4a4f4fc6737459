"""`GET /v1/messages/{queue_id}` and `GET /v1/messages`: what became of an org's mail.

A message's timeline is the same list of events `pigeon-mta log QUEUE_ID --json` prints, built by
the same functions (store/events.py reads the story, delivery_records.py makes the records), so
the command and the API cannot tell two stories. A key reads only its org's messages: another
org's queue id is answered as an unknown one, 404, so that ids of other orgs cannot be probed.
"""

from __future__ import annotations

import base64
import binascii
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg
from aiohttp import web

from pigeon_mta.api import problems
from pigeon_mta.api.auth import Authenticator
from pigeon_mta.api.problems import Problem
from pigeon_mta.delivery_records import story_records, timestamp_text
from pigeon_mta.intake.intent import META_NAME
from pigeon_mta.model import message_kind
from pigeon_mta.plain import is_digits
from pigeon_mta.store import events as store_events
from pigeon_mta.store import message_pages
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.events import RecipientRecord
from pigeon_mta.store.message_pages import Filters, Position

log = logging.getLogger("pigeon_mta.api")

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
LIST_PARAMETERS = ("recipient", "message_id", "status", "since", "limit", "cursor")
# `metadata.NAME=value`: messages whose metadata has NAME with that value (several: all of them).
METADATA_PREFIX = "metadata."
T = TypeVar("T")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class MessageReader:
    def __init__(self, pool: asyncpg.Pool, authenticate: Authenticator) -> None:
        self.pool = pool
        self.authenticate = authenticate

    async def get(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        text = request.match_info["queue_id"]
        try:
            queue_id = uuid.UUID(text)
        except ValueError:
            queue_id = None
        story = None
        if queue_id is not None:
            try:
                story = await store_events.story_of_org_message(self.pool, queue_id, key.org_id)
            except DB_ERRORS as exc:
                raise problems.database_error(
                    exc, "the message could not be read", f"API read of key {key.id}"
                ) from None
        if story is None:
            # A malformed id names no message, as an unknown one does: both are 404.
            raise Problem(
                problems.NOT_FOUND, f"The org has no message with the queue id '{text[:64]}'."
            )
        m = story.message
        return web.json_response(
            {
                "queue_id": str(m.id),
                "kind": message_kind(m.listener),
                "message_id": m.header_message_id,
                "sender": m.sender,
                "received_at": timestamp_text(m.received_at),
                "lane": m.lane,
                "size": m.size,
                "expires_at": timestamp_text(m.expires_at) if m.expires_at else None,
                "send_at": timestamp_text(m.send_at) if m.send_at else None,
                "order_key": m.order_key,
                "metadata": m.metadata,
                "recipients": [_recipient_state(r) for r in story.recipients],
                "events": story_records(story),
            }
        )

    async def list(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        filters, after, limit = _list_query(request)
        try:
            found = await message_pages.list_messages(
                self.pool, key.org_id, filters, after=after, limit=limit + 1
            )
            page = found[:limit]
            recipients = await store_events.recipients_of(self.pool, [m.queue_id for m in page])
        except DB_ERRORS as exc:
            raise problems.database_error(
                exc, "the messages could not be read", f"API read of key {key.id}"
            ) from None
        by_message: dict[uuid.UUID, list[RecipientRecord]] = {}
        for r in recipients:
            by_message.setdefault(r.queue_id, []).append(r)
        last = page[-1] if len(found) > limit else None
        return web.json_response(
            {
                "messages": [
                    {
                        "queue_id": str(m.queue_id),
                        "kind": message_kind(m.listener),
                        "message_id": m.header_message_id,
                        "received_at": timestamp_text(m.received_at),
                        "lane": m.lane,
                        "recipients": [_recipient_state(r) for r in by_message.get(m.queue_id, [])],
                    }
                    for m in page
                ],
                "next_cursor": encode_cursor(Position(last.received_at, last.queue_id))
                if last
                else None,
            }
        )


def _recipient_state(r: RecipientRecord) -> dict[str, Any]:
    return {
        "id": str(r.id),
        "address": r.address,
        "status": r.status,
        "attempts": r.attempts,
        "next_attempt_at": timestamp_text(r.next_attempt_at) if r.status == "queued" else None,
        "code": r.last_code,
        "enhanced_code": r.last_enhanced_code,
        "response": r.last_response,
        "updated_at": timestamp_text(r.updated_at),
    }


# ---------------------------------------------------------------- the query of a listing


def _list_query(request: web.Request) -> tuple[Filters, Position | None, int]:
    query = request.query
    metadata = []
    for name in query:
        if name.startswith(METADATA_PREFIX):
            meta = name.removeprefix(METADATA_PREFIX)
            if not META_NAME.fullmatch(meta):
                raise _bad(name, "must name metadata as the send intent does (a-z, 0-9, '-', '_')")
            metadata.append((meta, query[name]))
        elif name not in LIST_PARAMETERS:
            known = ", ".join((*LIST_PARAMETERS, METADATA_PREFIX + "NAME"))
            raise _bad(name, f"is not a parameter of this listing ({known})")
        if len(query.getall(name)) > 1:
            raise _bad(name, "is given more than once")
    recipient = query.get("recipient")
    if recipient is not None and ("@" not in recipient or len(recipient) > 320):
        raise _bad("recipient", "must be an email address")
    header_id = query.get("message_id")
    if header_id is not None:
        header_id = header_id.strip()
        if header_id.startswith("<") and header_id.endswith(">"):
            header_id = header_id[1:-1]
        if not header_id or len(header_id) > 998:
            raise _bad("message_id", "must be a Message-ID header value")
    status = query.get("status")
    if status is not None and status not in message_pages.STATUSES:
        raise _bad("status", f"must be one of {', '.join(message_pages.STATUSES)}")
    filters = Filters(
        addresses=store_events.address_spellings(recipient) if recipient else (),
        header_id=header_id,
        status=status,
        since=_parsed(query, "since", _timestamp, "must be an ISO 8601 date or time"),
        metadata=tuple(metadata),
    )
    limit = _parsed(query, "limit", _whole, f"must be a whole number from 1 to {MAX_LIMIT}")
    if limit is not None and not 1 <= limit <= MAX_LIMIT:
        raise _bad("limit", f"must be a whole number from 1 to {MAX_LIMIT}")
    after = _parsed(query, "cursor", decode_cursor, "is not a cursor this listing gave")
    return filters, after, limit or DEFAULT_LIMIT


def _parsed(query: Any, name: str, parse: Callable[[str], T], wrong: str) -> T | None:
    text = query.get(name)
    if text is None:
        return None
    try:
        return parse(text)
    except (ValueError, OverflowError):
        raise _bad(name, wrong) from None


def _whole(text: str) -> int:
    if not is_digits(text) or len(text) > 9:
        raise ValueError(text)
    return int(text)


def _timestamp(text: str) -> datetime:
    """ISO 8601; UTC unless it names an offset (a '+' in a query is written %2B). In UTC it
    must be a date Python and PostgreSQL both hold (OverflowError otherwise: 0001-01-01 with a
    positive offset, 9999-12-31 with a negative one)."""
    when = datetime.fromisoformat(text)
    when = when if when.tzinfo else when.replace(tzinfo=UTC)
    return when.astimezone(UTC)


def _bad(name: str, wrong: str) -> Problem:
    return Problem(problems.INVALID_PARAMETER, f"The query parameter '{name[:40]}' {wrong}.")


def encode_cursor(position: Position) -> str:
    """Opaque to clients: the last message's receipt time (microseconds) and queue id."""
    micros = (position.received_at - _EPOCH) // timedelta(microseconds=1)
    text = f"{micros}.{position.queue_id.hex}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> Position:
    """A Position from a cursor; ValueError when it is not one encode_cursor made."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError(cursor) from None
    micros, _, queue_id = text.partition(".")
    if not is_digits(micros) or len(micros) > 20:
        raise ValueError(cursor)
    try:
        when = _EPOCH + timedelta(microseconds=int(micros))
    except OverflowError:
        raise ValueError(cursor) from None
    return Position(when, uuid.UUID(hex=queue_id))
