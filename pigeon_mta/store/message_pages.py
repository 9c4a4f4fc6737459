"""An org's messages, newest first, a page at a time: `GET /v1/messages` of the HTTP API.

Pages are ordered by (received_at, id), descending: received_at is when the message was accepted
and the queue id (a UUIDv7) breaks ties between messages of one instant. A page ends with a
`Position`, the (received_at, id) of its last message; the next page holds what sorts below it.
Mail accepted later sorts above it, so paging reads every message that existed when it started
exactly once, however much mail arrives meanwhile.

Each filter picks the index that serves it, and every statement stops after a page:
- none, `since`, a live or delivered `status`: message_org_received (org_id, received_at), read
  backwards; a status is checked per message through recipient_message (such recipients are the
  newest or the most).
- a failed `status` (FAILED): recipient_failed (org_id, status, created_at, message_id), a
  partial index of those rows alone, read backwards: they may be rare, and a walk of the org's
  messages to find a page of them could read its whole history.
- `header_id`: message_header_id.
- `addresses` (the spellings of one recipient address): recipient_address (address,
  created_at), read backwards per spelling; a recipient row's created_at is its message's
  received_at (store/queue.py writes both from one value), so the order is the same.
Each variant is its own statement text, so that PostgreSQL plans it with the filters it has.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pigeon_mta.store.executor import Executor

# The per-recipient states of the recipient table.
STATUSES = ("queued", "delivering", "delivered", "bounced", "expired", "cancelled", "suppressed")
# The final states that are not a delivery: recipient_failed's predicate (migration 0022).
FAILED = ("bounced", "expired", "cancelled", "suppressed")
_IN_FAILED = f"r.status IN ({', '.join(repr(s) for s in FAILED)})"


@dataclass(frozen=True)
class Position:
    """Where a page ended: its last message."""

    received_at: datetime
    queue_id: uuid.UUID


@dataclass(frozen=True)
class ListedMessage:
    queue_id: uuid.UUID
    header_message_id: str | None
    received_at: datetime
    lane: str
    listener: str = ""  # model.DSN_LISTENER for a delivery status notification pigeon made


@dataclass(frozen=True)
class Filters:
    addresses: Sequence[str] = ()  # spellings of one recipient address (events.address_spellings)
    header_id: str | None = None  # the Message-ID header value, without angle brackets
    status: str | None = None  # one of STATUSES: messages with a recipient in that state
    since: datetime | None = None  # received at or after
    # (name, value) pairs the message's metadata (the send intent's) must all have.
    metadata: Sequence[tuple[str, str]] = ()


class _Arguments:
    """Numbered statement parameters ($1, $2, ...) in the order they are added."""

    def __init__(self) -> None:
        self.values: list[Any] = []

    def __call__(self, value: Any) -> str:
        self.values.append(value)
        return f"${len(self.values)}"


async def list_messages(
    db: Executor,
    org_id: uuid.UUID,
    filters: Filters,
    *,
    after: Position | None,
    limit: int,
) -> list[ListedMessage]:
    """The org's messages that match `filters` and sort below `after`, newest first, at most
    `limit`."""
    sql, arguments = listing_statement(org_id, filters, after=after, limit=limit)
    rows = await db.fetch(sql, *arguments)
    return [
        ListedMessage(
            queue_id=r["id"],
            header_message_id=r["header_message_id"],
            received_at=r["received_at"],
            lane=r["lane"],
            listener=r["listener"],
        )
        for r in rows
    ]


def listing_statement(
    org_id: uuid.UUID, filters: Filters, *, after: Position | None, limit: int
) -> tuple[str, list[Any]]:
    """The statement of list_messages and its arguments (the plan tests EXPLAIN it)."""
    arg = _Arguments()
    org = arg(org_id)
    if filters.metadata:
        # Few messages of an org share a metadata value: the org's messages, newest first,
        # through the metadata's index, and the other filters on those.
        return _of_org(arg, org, filters, after, limit), arg.values
    if filters.addresses:
        return _to_address(arg, org, filters, after, limit), arg.values
    if filters.status in FAILED and filters.header_id is None:
        return _failed(arg, org, filters, after, limit), arg.values
    return _of_org(arg, org, filters, after, limit), arg.values


def _of_org(arg: _Arguments, org: str, filters: Filters, after: Position | None, limit: int) -> str:
    where = [f"m.org_id = {org}"]
    if filters.since is not None:
        where.append(f"m.received_at >= {arg(filters.since)}")
    if after is not None:
        where.append(f"(m.received_at, m.id) < ({arg(after.received_at)}, {arg(after.queue_id)})")
    if filters.header_id is not None:
        where.append(f"m.header_message_id = {arg(filters.header_id)}")
    if filters.status is not None:
        where.append(
            "EXISTS (SELECT 1 FROM recipient r "
            f"WHERE r.message_id = m.id AND r.status = {arg(filters.status)})"
        )
    if filters.metadata:
        where.append(f"m.metadata @> {arg(json.dumps(dict(filters.metadata)))}::jsonb")
    if filters.addresses:
        where.append(
            "EXISTS (SELECT 1 FROM recipient r WHERE r.message_id = m.id "
            f"AND r.address = ANY ({arg(list(filters.addresses))}::text[]))"
        )
    return f"""
SELECT m.id, m.header_message_id, m.received_at, m.lane, m.listener FROM message m
WHERE {" AND ".join(where)}
ORDER BY m.received_at DESC, m.id DESC LIMIT {arg(limit)}
"""


def _failed(arg: _Arguments, org: str, filters: Filters, after: Position | None, limit: int) -> str:
    # The IN list repeats the index predicate, so that a generic plan (status as a parameter)
    # can use the partial index too. DISTINCT: a message may have several such recipients; the
    # index is in (created_at, message_id) order, so the distinct ones come out streamed.
    where = [f"r.org_id = {org}", f"r.status = {arg(filters.status)}", _IN_FAILED]
    if filters.since is not None:
        where.append(f"r.created_at >= {arg(filters.since)}")
    if after is not None:
        where.append(
            f"(r.created_at, r.message_id) < ({arg(after.received_at)}, {arg(after.queue_id)})"
        )
    return f"""
SELECT m.id, m.header_message_id, m.received_at, m.lane, m.listener
FROM (SELECT DISTINCT r.created_at, r.message_id FROM recipient r
      WHERE {" AND ".join(where)}
      ORDER BY r.created_at DESC, r.message_id DESC LIMIT {arg(limit)}) hit
JOIN message m ON m.id = hit.message_id
ORDER BY m.received_at DESC, m.id DESC
"""


def _to_address(
    arg: _Arguments, org: str, filters: Filters, after: Position | None, limit: int
) -> str:
    # The newest `limit` below `after` of each spelling, then the newest `limit` of those (as
    # store/events.py finds an address's messages): "address = ANY (spellings)" has no single
    # index order, and PostgreSQL would read the address's whole history to sort it. Each
    # spelling is read in the index's own order, created_at, WITH TIES: ordered by
    # (created_at, message_id) PostgreSQL sorted the address's whole history; the ties keep
    # every message of the last instant, which the outer order then sorts by id.
    spellings = arg(list(filters.addresses))
    where = ["r.address = spelling.address", f"r.org_id = {org}"]
    if filters.since is not None:
        where.append(f"r.created_at >= {arg(filters.since)}")
    if after is not None:
        where.append(
            f"(r.created_at, r.message_id) < ({arg(after.received_at)}, {arg(after.queue_id)})"
        )
    if filters.status is not None:
        where.append(f"r.status = {arg(filters.status)}")
    if filters.header_id is not None:
        where.append(
            "EXISTS (SELECT 1 FROM message h "
            f"WHERE h.id = r.message_id AND h.header_message_id = {arg(filters.header_id)})"
        )
    count = arg(limit)
    return f"""
SELECT DISTINCT m.id, m.header_message_id, m.received_at, m.lane, m.listener
FROM unnest({spellings}::text[]) AS spelling (address)
CROSS JOIN LATERAL (SELECT r.message_id FROM recipient r
                    WHERE {" AND ".join(where)}
                    ORDER BY r.created_at DESC FETCH FIRST {count} ROWS WITH TIES) hit
JOIN message m ON m.id = hit.message_id
ORDER BY m.received_at DESC, m.id DESC LIMIT {count}
"""
