"""`/v1/suppressions[/{address}]`: the key's org's suppression list over HTTP.

The same list and rules as `pigeon-mta suppress add|remove|list` (store/suppression.py): addresses
are kept in lower case, an entry added by hand replaces a bounce's, and an expired entry counts as
absent. A key sees and changes only its org's entries; an address another org suppressed is, for
this key, not on the list (404).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
from aiohttp import web

from pigeon_mta.api import problems
from pigeon_mta.api.auth import Authenticator
from pigeon_mta.api.problems import Problem
from pigeon_mta.delivery_records import timestamp_text
from pigeon_mta.plain import is_digits
from pigeon_mta.store import suppression as store_suppression
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.suppression import Suppression

log = logging.getLogger("pigeon_mta.api")

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
FIELDS = frozenset({"address", "reason", "expires_at"})
_MAX_REASON = 1000
T = TypeVar("T")


class SuppressionHandler:
    def __init__(self, pool: asyncpg.Pool, authenticate: Authenticator) -> None:
        self.pool = pool
        self.authenticate = authenticate

    async def list(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        after, limit = _page_query(request)
        entries = await self._db(
            store_suppression.page_suppressions(
                self.pool, key.org_id, after=after, limit=limit + 1
            ),
            "the list could not be read",
        )
        page = entries[:limit]
        return web.json_response(
            {
                "suppressions": [entry_json(e) for e in page],
                "next_cursor": page[-1].address if len(entries) > limit else None,
            }
        )

    async def get(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        address = request.match_info["address"]
        entry = await self._db(
            store_suppression.find_suppression(self.pool, key.org_id, address),
            "the list could not be read",
        )
        if entry is None:
            raise _absent(address)
        return web.json_response(entry_json(entry))

    async def post(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        if request.content_type != "application/json":
            raise Problem(
                problems.UNSUPPORTED_MEDIA_TYPE,
                f"The Content-Type '{request.content_type[:64]}' is not application/json.",
            )
        address, reason, expires_at = _entry_request(await request.read())
        entry, new = await self._db(
            store_suppression.add_suppression(
                self.pool, key.org_id, address, reason=reason, expires_at=expires_at
            ),
            "the address was not suppressed",
        )
        log.info("API key %s suppressed %s (%s)", key.id, entry.address, "new" if new else "again")
        return web.json_response(entry_json(entry), status=201 if new else 200)

    async def delete(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        address = request.match_info["address"]
        removed = await self._db(
            store_suppression.remove_suppression(self.pool, key.org_id, address),
            "the address was not removed",
        )
        if not removed:
            raise _absent(address)
        log.info("API key %s removed %s from the suppression list", key.id, address[:320])
        return web.Response(status=204)

    async def _db(self, call: Awaitable[T], consequence: str) -> T:
        try:
            return await call
        except DB_ERRORS as exc:
            raise problems.database_error(exc, consequence, "API suppression request") from None


def entry_json(entry: Suppression) -> dict[str, Any]:
    return {
        "address": entry.address,
        "reason": entry.reason,
        "source": entry.source,
        "created_at": timestamp_text(entry.created_at),
        "expires_at": timestamp_text(entry.expires_at) if entry.expires_at else None,
    }


def _absent(address: str) -> Problem:
    return Problem(
        problems.NOT_FOUND, f"The address '{address[:320]}' is not on the org's suppression list."
    )


def _page_query(request: web.Request) -> tuple[str | None, int]:
    for name in request.query:
        if name not in ("limit", "cursor"):
            raise _bad_parameter(name, "is not a parameter of this listing (limit, cursor)")
    limit = DEFAULT_LIMIT
    if "limit" in request.query:
        text = request.query["limit"]
        if not is_digits(text) or not 1 <= int(text) <= MAX_LIMIT:
            raise _bad_parameter("limit", f"must be a whole number from 1 to {MAX_LIMIT}")
        limit = int(text)
    # The cursor is the last address of the previous page: the list is read in address order.
    return request.query.get("cursor"), limit


def _bad_parameter(name: str, wrong: str) -> Problem:
    return Problem(problems.INVALID_PARAMETER, f"The query parameter '{name[:40]}' {wrong}.")


def _entry_request(body: bytes) -> tuple[str, str, datetime | None]:
    """address, reason and expires_at of a POST body; a Problem naming the field at fault."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Problem(problems.INVALID_JSON, "The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise Problem(problems.INVALID_JSON, "The request body must be a JSON object.")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise _field(f"The field '{unknown[0][:40]}' is not one of {', '.join(sorted(FIELDS))}.")
    for name in ("address", "reason", "expires_at"):
        value = data.get(name)
        if isinstance(value, str) and problems.unstorable(value):
            raise Problem(
                problems.INVALID_VALUE,
                f"The field '{name}' holds a NUL character or an unpaired surrogate.",
            )
    address = data.get("address")
    if not isinstance(address, str):
        raise _field("The field 'address' must be a string: the address to suppress.")
    address = store_suppression.normalise_address(address)
    if len(address) > 320 or not store_suppression.looks_like_address(address):
        raise Problem(
            problems.INVALID_ADDRESS, f"The field 'address' ('{address[:64]}') is not an address."
        )
    reason = data.get("reason")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > _MAX_REASON:
        raise _field(f"The field 'reason' must be a non-empty string of at most {_MAX_REASON}.")
    if "\r" in reason or "\n" in reason:
        raise _field("The field 'reason' must be one line (no CR or LF).")
    expires_at = data.get("expires_at")
    if expires_at is None:
        return address, reason, None
    if not isinstance(expires_at, str):
        raise _field("The field 'expires_at' must be an ISO 8601 date-time string.")
    try:
        when = datetime.fromisoformat(expires_at)
        when = (when if when.tzinfo else when.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        raise _field(
            "The field 'expires_at' must be an ISO 8601 date-time string of a year from 1 to 9999."
        ) from None
    if when <= datetime.now(UTC):
        raise _field("The field 'expires_at' is in the past: the entry would never apply.")
    return address, reason, when


def _field(detail: str) -> Problem:
    return Problem(problems.INVALID_FIELD, detail)
