"""The HTTP API of one worker process, as a `Service`: its routes, its refusals, its listener.

Every worker process binds `[api] listen` with SO_REUSEPORT (as the SMTP listeners do, see
submission/service.py) and queues through its own group commit, the one its SMTP listeners use.
It reports its socket bound as they do, under the listener name `api` (observability/health.py).
Every refusal leaves as `application/problem+json` (problems.py), aiohttp's own (404, 405, a body
over the size limit) included; an unexpected error is logged and answered 500.

A request's body is read only after its key is found (auth.py), and only within the room the
process has for bodies (`api.max_body_memory`, `BodyRoom`): a client without a key cannot make a
worker hold its body, and clients with keys cannot make it hold more than that at once. A request
refused before its body was read closes its connection, so the body is never read at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
from aiohttp import web
from aiohttp.typedefs import Middleware

from pigeon_mta.api import problems
from pigeon_mta.api.auth import Authenticator
from pigeon_mta.api.openapi import openapi_document
from pigeon_mta.api.problems import Problem
from pigeon_mta.api.reading import MessageReader
from pigeon_mta.api.send import SendHandler
from pigeon_mta.api.suppressions import SuppressionHandler
from pigeon_mta.config import API_LISTENER, Settings
from pigeon_mta.intake.accept import Intake
from pigeon_mta.metrics import API_REQUEST_SECONDS, API_REQUESTS, LISTENERS_BOUND
from pigeon_mta.plain import plain_text
from pigeon_mta.web import WebServer

log = logging.getLogger("pigeon_mta.api")

# Room for a message of limits.max_message_size as base64 in JSON (4/3 of it) and its fields.
_BODY_SLACK = 1024 * 1024
# How long a connection cut off with an answer stays open, unread, for the client to read it.
CUT_OFF_LINGER = 1.0
_NO_LIMIT_BODY = 1024**3

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    settings: Settings,
    pool: asyncpg.Pool,
    intake: Intake,
) -> web.Application:
    size = settings.limits.max_message_size
    largest = size * 2 + _BODY_SLACK if size else _NO_LIMIT_BODY
    authenticate = Authenticator(pool, cache=settings.api.auth_cache, limits=settings.limits)
    room = BodyRoom(max(settings.api.max_body_memory, min(largest, _NO_LIMIT_BODY)))
    app = web.Application(
        client_max_size=largest,
        middlewares=[
            _measured,
            _problems,
            _storable_parameters,
            _body_after_key(authenticate, room, largest, settings.api.read_timeout),
        ],
    )
    send = SendHandler(settings, pool, intake, authenticate)
    messages = MessageReader(pool, authenticate)
    suppressions = SuppressionHandler(pool, authenticate)
    app.router.add_post("/v1/messages", send.post)
    app.router.add_get("/v1/messages", messages.list)
    app.router.add_get("/v1/messages/{queue_id}", messages.get)
    app.router.add_get("/v1/suppressions", suppressions.list)
    app.router.add_post("/v1/suppressions", suppressions.post)
    app.router.add_get("/v1/suppressions/{address}", suppressions.get)
    app.router.add_delete("/v1/suppressions/{address}", suppressions.delete)
    app.router.add_get("/v1/openapi.json", _openapi)
    return app


class NoRoom(Exception):
    """The room for bodies had not enough free within the time allowed."""


class BodyRoom:
    """The bytes of request bodies one process holds at once, at most `capacity`: a request
    reserves its Content-Length (a body without one, the largest the server reads) before its body
    is read and gives it back once it is answered. A body as large as the room waits until it is
    alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def reserve(self, size: int, *, within: float) -> AsyncIterator[None]:
        """Hold `size` bytes of the room; NoRoom when they are not free within `within`."""
        size = min(size, self.capacity)
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait_for(lambda: self.used + size <= self.capacity)
                self.used += size
        except TimeoutError:
            raise NoRoom from None
        try:
            yield
        finally:
            async with self._changed:
                self.used -= size
                self._changed.notify_all()


def _body_after_key(
    authenticate: Authenticator, room: BodyRoom, largest: int, read_timeout: float
) -> Middleware:
    """A middleware that finds a request's key, then reads its body, which aiohttp reads with no
    deadline, within the room for bodies and within `read_timeout` of its head (the head's own
    bound is the server's keep-alive timeout, see web.py). A client that trickles its body is
    answered 408 and cut off at once, not given the lingering read aiohttp grants a body left
    unread. The body read here is the one the handler's `request.read()` returns, and the key
    found the one its `authenticate(request)` returns."""

    @web.middleware
    async def body_after_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists or request.match_info.http_exception is not None:
            return await handler(request)
        await authenticate(request)
        if request.content_length is not None and request.content_length > largest:
            # Refused unread (the connection is closed): aiohttp would read it up to its limit.
            raise Problem(
                problems.TOO_LARGE,
                f"The request body is {request.content_length} bytes; the server reads at most "
                f"{largest} (twice limits.max_message_size and a MiB).",
            )
        size = request.content_length if request.content_length is not None else largest
        try:
            async with room.reserve(size, within=read_timeout):
                return await _read_then_handle(request, handler, read_timeout)
        except NoRoom:
            log.warning(
                "API request from [%s] refused: %d bytes of request bodies held already",
                request.remote,
                room.used,
            )
            raise Problem(
                problems.BUSY,
                f"The server holds {room.capacity} bytes of request bodies (api.max_body_memory) "
                "and had no room for this one in time.",
                retry_after=1,
            ) from None

    return body_after_key


async def _answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send `response` and close the connection, whatever of the body is unread: the answer goes
    out with a FIN after it, reading stops, and the socket is closed CUT_OFF_LINGER later. Closed
    at once, a socket with unread bytes sends a reset, which can reach the client before it has
    read the answer, and the kernel then throws the answer away."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    transport = request.transport
    if transport is not None and not transport.is_closing() and transport.can_write_eof():
        transport.pause_reading()
        transport.write_eof()
        await asyncio.sleep(CUT_OFF_LINGER)
    request.protocol.force_close()
    return response


# Set on a request whose body the middleware has read (the connection can be kept alive).
_BODY_READ = web.RequestKey("pigeon.body_read", bool)


async def _read_then_handle(
    request: web.Request, handler: Handler, read_timeout: float
) -> web.StreamResponse:
    try:
        async with asyncio.timeout(read_timeout):
            await request.read()
    except TimeoutError:
        log.info(
            "API request from [%s] cut off: its body took over %g s", request.remote, read_timeout
        )
        # Raised, not answered here: the body's room is given back before the answer's linger
        # (_problems answers and closes, the body unread).
        raise Problem(
            problems.REQUEST_TIMEOUT,
            f"The request body did not arrive within {read_timeout:g} seconds.",
        ) from None
    request[_BODY_READ] = True
    return await handler(request)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@web.middleware
async def _measured(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every answer counted by route, method and status, and timed by route."""
    started = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        method = request.method if request.method in _METHODS else "other"
        API_REQUESTS.labels(route=route, method=method, status=str(status)).inc()
        API_REQUEST_SECONDS.labels(route=route).observe(time.monotonic() - started)


@web.middleware
async def _storable_parameters(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The query parameters and path segments of a request hold nothing PostgreSQL's text cannot
    (a NUL, an unpaired surrogate): refused here, 422, never sent to a query to come back as a
    database error."""
    for name, value in [*request.query.items(), *request.match_info.items()]:
        if problems.unstorable(name) or problems.unstorable(value):
            raise Problem(
                problems.INVALID_VALUE,
                f"The parameter '{plain_text(name, 40)}' holds a NUL character or an unpaired "
                "surrogate, which the server cannot store or look up.",
            )
    return await handler(request)


async def _openapi(_request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


_AIOHTTP_PROBLEMS = {
    404: (problems.NOT_FOUND, "There is no route {path}; see /v1/openapi.json."),
    405: (problems.METHOD_NOT_ALLOWED, "The method {method} is not allowed on {path}."),
    413: (problems.TOO_LARGE, "The request body is over the size the server reads."),
}


@web.middleware
async def _problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Problem as problem:
        if request.body_exists and not request.get(_BODY_READ):
            # Refused before its body was read: the body is not read at all, not even by the
            # lingering read aiohttp grants a body left unread (10 s of it).
            return await _answer_and_close(request, problem.response())
        return problem.response()
    except web.HTTPException as exc:
        known = _AIOHTTP_PROBLEMS.get(exc.status)
        if known is None:
            raise
        kind, detail = known
        path = request.path[:100]
        response = Problem(kind, detail.format(path=path, method=request.method)).response()
        if isinstance(exc, web.HTTPMethodNotAllowed):
            response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return response
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path[:100])
        return Problem(problems.INTERNAL_ERROR, "The request failed in the server.").response()


class ApiService:
    """The API's listener in one worker process."""

    name = "api"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        intake: Intake,
    ) -> None:
        if settings.api.listen is None:
            raise ValueError("'api.listen' is empty: the settings have no HTTP API to serve")
        self.settings = settings
        app = build_app(settings, pool, intake)
        self.server = WebServer(
            app,
            settings.api.listen,
            reuse_port=True,
            keepalive_timeout=settings.api.read_timeout,
            error_response=problems.parser_refusal,
        )

    async def start(self) -> None:
        api = self.settings.api
        if api.tls_cert:
            self.server.ssl_context = await asyncio.to_thread(
                _tls_context, api.tls_cert, api.tls_key
            )
        try:
            await self.server.start()
        except OSError as exc:
            raise RuntimeError(
                f"the HTTP API cannot bind 'api.listen' {api.listen}: {exc.strerror or exc}"
            ) from None
        LISTENERS_BOUND.labels(listener=API_LISTENER).set(1)
        log.info(
            "HTTP API on %s://%s",
            "https" if api.tls_cert else "http",
            _shown(api.listen, self.server.port),
        )

    async def stop(self, deadline: float) -> None:
        """Stop accepting; requests under way (their commits included) get web.SHUTDOWN_TIMEOUT."""
        LISTENERS_BOUND.labels(listener=API_LISTENER).set(0)
        await self.server.stop()


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise RuntimeError(
            f"cannot load 'api.tls_cert' {cert} with 'api.tls_key' {key}: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None
    return context


def _shown(listen: object, port: int) -> str:
    host = getattr(listen, "host", "")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
