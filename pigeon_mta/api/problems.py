"""Refusals of the HTTP API as RFC 9457 problem details (`application/problem+json`).

Each kind of refusal is a `ProblemType` constant with its status and title, so that the code, the
OpenAPI document and the tests name the same ones. A `Problem` is raised with a `detail`: one
sentence that names the field at fault.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from aiohttp import web

from pigeon_mta.model import storable_text
from pigeon_mta.store.errors import is_bad_input

log = logging.getLogger("pigeon_mta.api")

CONTENT_TYPE = "application/problem+json"
# Problem type URIs are names, not pages (RFC 9457 3.1.1 allows a URI that cannot be fetched).
TYPE_PREFIX = "urn:pigeon-mta:problem:"


@dataclass(frozen=True)
class ProblemType:
    slug: str
    status: int
    title: str

    @property
    def uri(self) -> str:
        return TYPE_PREFIX + self.slug


INVALID_REQUEST = ProblemType("invalid-request", 400, "The request cannot be read as HTTP")
INVALID_JSON = ProblemType("invalid-json", 400, "The request body is not valid JSON")
INVALID_MESSAGE = ProblemType(
    "invalid-message", 400, "The message is not a readable RFC 5322 message"
)
INVALID_PARAMETER = ProblemType(
    "invalid-parameter", 400, "A query parameter is malformed or unknown"
)
UNAUTHORIZED = ProblemType("unauthorized", 401, "A valid API key is needed")
SENDER_NOT_OWNED = ProblemType("sender-not-owned", 403, "The org may not send as this address")
NOT_FOUND = ProblemType("not-found", 404, "There is nothing here")
METHOD_NOT_ALLOWED = ProblemType("method-not-allowed", 405, "This method is not allowed here")
REQUEST_TIMEOUT = ProblemType("request-timeout", 408, "The request was not received in time")
TOO_LARGE = ProblemType("too-large", 413, "The message is over limits.max_message_size")
UNSUPPORTED_MEDIA_TYPE = ProblemType(
    "unsupported-media-type", 415, "Send application/json or message/rfc822"
)
INVALID_FIELD = ProblemType("invalid-field", 422, "A field of the request is missing or wrong")
INVALID_ADDRESS = ProblemType("invalid-address", 422, "An address is not a valid mailbox")
INVALID_HEADER = ProblemType("invalid-header", 422, "A header field name or value is not allowed")
TOO_MANY_RECIPIENTS = ProblemType(
    "too-many-recipients", 422, "The message has more recipients than limits.max_recipients"
)
UNKNOWN_LANE = ProblemType("unknown-lane", 422, "The lane is not one of the server's lanes")
IDEMPOTENCY_KEY_REUSED = ProblemType(
    "idempotency-key-reused", 422, "The Idempotency-Key was used with another request"
)
INVALID_VALUE = ProblemType(
    "invalid-value", 422, "A value of the request is one the server cannot store"
)
RATE_LIMITED = ProblemType("rate-limited", 429, "The API key's message rate limit is reached")
TOO_MANY_KEY_FAILURES = ProblemType(
    "too-many-key-failures", 429, "Too many requests with a wrong API key from this address"
)
INTERNAL_ERROR = ProblemType("internal-error", 500, "The server failed; see its log")
DATABASE_UNAVAILABLE = ProblemType(
    "database-unavailable", 503, "The database is unavailable; try again later"
)
BUSY = ProblemType(
    "busy", 503, "The server holds as many request bodies as it may at once; try again shortly"
)

ALL = (
    INVALID_REQUEST,
    INVALID_JSON,
    INVALID_MESSAGE,
    INVALID_PARAMETER,
    UNAUTHORIZED,
    SENDER_NOT_OWNED,
    NOT_FOUND,
    METHOD_NOT_ALLOWED,
    REQUEST_TIMEOUT,
    TOO_LARGE,
    UNSUPPORTED_MEDIA_TYPE,
    INVALID_FIELD,
    INVALID_ADDRESS,
    INVALID_HEADER,
    TOO_MANY_RECIPIENTS,
    UNKNOWN_LANE,
    IDEMPOTENCY_KEY_REUSED,
    INVALID_VALUE,
    RATE_LIMITED,
    TOO_MANY_KEY_FAILURES,
    INTERNAL_ERROR,
    DATABASE_UNAVAILABLE,
    BUSY,
)


class Problem(Exception):
    """A refusal, raised anywhere in a request's handling and answered by the middleware."""

    def __init__(self, kind: ProblemType, detail: str, *, retry_after: int | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.retry_after = retry_after

    def response(self) -> web.Response:
        body = {
            "type": self.kind.uri,
            "title": self.kind.title,
            "status": self.kind.status,
            "detail": self.detail,
        }
        response = web.Response(status=self.kind.status, body=json.dumps(body).encode())
        response.headers["Content-Type"] = CONTENT_TYPE
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        if self.kind is UNAUTHORIZED:
            response.headers["WWW-Authenticate"] = 'Bearer realm="pigeon-mta"'
        return response


# Seconds a client is asked to wait after database trouble.
RETRY_AFTER_DATABASE = 5


def database_unavailable(consequence: str) -> Problem:
    """503: `consequence` says what could not be done ("the message was not queued")."""
    return Problem(
        DATABASE_UNAVAILABLE,
        f"The database is unavailable, so {consequence}.",
        retry_after=RETRY_AFTER_DATABASE,
    )


def database_error(exc: BaseException, consequence: str, who: str | None) -> Problem:
    """The answer to a database call that raised `exc`, logged for `who` ("API read of key K";
    None: the caller logged it already, as the intake does). A value the database refuses
    (`is_bad_input`: a NUL, a lone surrogate, a date out of its range) is the client's, 422,
    logged as such: a client must not be able to fake a database outage, and its alerts, at will.
    Anything else is the database's trouble, 503."""
    if is_bad_input(exc):
        if who is not None:
            log.info("%s: refused a value the database cannot store: %s", who, exc)
        return Problem(
            INVALID_VALUE,
            "A value of the request cannot be stored (a NUL character, an unpaired surrogate, "
            "or a date or number out of range).",
        )
    if who is not None:
        log.warning("%s: database trouble: %s", who, exc)
    return database_unavailable(consequence)


def unstorable(text: str) -> bool:
    """Whether `text` holds what PostgreSQL's text cannot: a NUL, or an unpaired surrogate
    (JSON's "\\ud800" decodes to one): what `model.storable_text` would change."""
    return storable_text(text) != text


def shown(text: str, limit: int = 64) -> str:
    """Client text made safe to repeat in a detail: printable, and not too long."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parser_refusal(status: int, message: str) -> web.Response:
    """The answer to a request aiohttp's parser refused before the API saw it (a header line
    over 8,190 bytes, an unknown Content-Encoding, both Content-Length and Transfer-Encoding):
    problem+json like every other answer, with what the parser said."""
    kind = {400: INVALID_REQUEST, 408: REQUEST_TIMEOUT, 413: TOO_LARGE}.get(status, INTERNAL_ERROR)
    said = " ".join(message.split()) or kind.title
    return Problem(kind, f"The request was refused as it was read: {shown(said, 200)}").response()
