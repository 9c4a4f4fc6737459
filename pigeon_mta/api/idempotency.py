"""The `Idempotency-Key` of a send: what an earlier use of the key left, the claim of the key
before the enqueue, and the answer kept after it (store/idempotency.py keeps them; api/send.py
says why the claim names the queue id).

A claim is never given up, not even when the enqueue fails: a failure may come after the commit
(the connection broke before its answer arrived), and a repeat that made a new claim would queue
the message a second time. Under the claimed queue id a repeat queues the message only if no
request did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass

import asyncpg
from aiohttp import web

from pigeon_mta.api import problems
from pigeon_mta.api.problems import Problem
from pigeon_mta.store import idempotency as store_idempotency
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger("pigeon_mta.api")

HEADER = "Idempotency-Key"
MAX_KEY = 255
JSON = "application/json"


@dataclass(frozen=True)
class Idempotency:
    pool: asyncpg.Pool
    org_id: uuid.UUID
    key: str
    request_hash: bytes  # of the method, path, query, content type and body (parsed, for JSON)
    # The same with the body byte for byte, as the release before stored it: a retry that
    # straddles a node's upgrade is still the same request.
    raw_hash: bytes = b""

    @classmethod
    def of(
        cls, request: web.Request, body: bytes, pool: asyncpg.Pool, org_id: uuid.UUID
    ) -> Idempotency | None:
        """The request's key, None without the header; a Problem for a malformed one."""
        value = request.headers.get(HEADER)
        if value is None:
            return None
        if not 0 < len(value) <= MAX_KEY or not all(" " <= c <= "~" for c in value):
            raise Problem(
                problems.INVALID_HEADER,
                f"The {HEADER} header must be 1 to {MAX_KEY} printable ASCII characters.",
            )
        digest = hashlib.sha256()
        for part in (request.method, request.path, request.query_string, request.content_type):
            digest.update(part.encode("utf-8", "surrogateescape") + b"\0")
        raw = digest.copy()
        raw.update(body)
        digest.update(_comparable(request.content_type, body))
        return cls(pool, org_id, value, digest.digest(), raw.digest())

    async def earlier(self) -> web.Response | uuid.UUID | None:
        """The stored answer to an earlier use of the key, or the queue id of one not answered
        yet, or None for a key not used within the TTL. 422 for a use with another request."""
        try:
            found = await store_idempotency.find(self.pool, self.org_id, self.key)
        except DB_ERRORS as exc:
            raise problems.database_error(
                exc, f"the {HEADER} could not be looked up", "Idempotency-Key lookup"
            ) from None
        return self._replay(found)

    async def claim(self, queue_id: uuid.UUID) -> web.Response | uuid.UUID:
        """The queue id to queue under: `queue_id` when the claim is ours, else that of the
        request that claimed the key first (or its stored answer). Raises on DB trouble."""
        found = await store_idempotency.claim(
            self.pool, self.org_id, self.key, self.request_hash, queue_id
        )
        if found is None:
            return queue_id
        replayed = self._replay(found)
        assert replayed is not None
        return replayed

    async def remember(self, queue_id: uuid.UUID, status: int, body: bytes) -> None:
        try:
            await store_idempotency.remember_answer(
                self.pool, self.org_id, self.key, queue_id, status, body
            )
        except DB_ERRORS as exc:
            # A repeat answers from the queued rows instead (api/send.py).
            log.warning("the answer for the %s of %s is not stored: %s", HEADER, queue_id, exc)

    def _replay(
        self, found: store_idempotency.Remembered | None
    ) -> web.Response | uuid.UUID | None:
        if found is None:
            return None
        if found.request_hash not in (self.request_hash, self.raw_hash):
            raise Problem(
                problems.IDEMPOTENCY_KEY_REUSED,
                f"The {HEADER} header was used within 24 hours for a request with another body "
                "or query.",
            )
        if found.status is not None and found.response is not None:
            return json_response(found.status, found.response)
        return found.queue_id


def json_response(status: int, body: bytes) -> web.Response:
    response = web.Response(status=status, body=body)
    response.headers["Content-Type"] = JSON
    return response


def _comparable(content_type: str, body: bytes) -> bytes:
    """What two requests must share to be the same: a JSON body as parsed (its spacing and key
    order are the client's library's, not the request's), any other body byte for byte."""
    if content_type != "application/json":
        return body
    try:
        parsed = json.loads(body)
    except ValueError:
        return body  # refused as invalid JSON all the same
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
