"""Serving an aiohttp application on one `host:port`: the one HTTP server of a node.

The metrics endpoint (observability/http.py) and the HTTP API (api/server.py) are each an aiohttp
`Application`; `WebServer` binds it, says where, and stops it. The API is bound by every worker
process on the same port (`reuse_port`, as the SMTP listeners are: the kernel spreads new
connections over the processes).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from pigeon_mta.config import HostPort

# A client whose keep-alive connection stays idle this long is closed.
KEEPALIVE_TIMEOUT = 75.0
# How long stop() lets requests under way finish.
SHUTDOWN_TIMEOUT = 5.0


# What answers a request that aiohttp's parser refused before the application saw it (a header
# line over 8,190 bytes, an unknown Content-Encoding, both Content-Length and Transfer-Encoding):
# the status aiohttp chose and its message in, the response out.
ErrorResponse = Callable[[int, str], web.Response]


class WebServer:
    def __init__(
        self,
        app: web.Application,
        listen: HostPort,
        *,
        reuse_port: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        error_response: ErrorResponse | None = None,
    ) -> None:
        """`keepalive_timeout` also bounds the wait for a request's line and header fields:
        aiohttp arms it when a connection opens and after each answer, and closes a connection
        still waiting for a whole request head when it runs out, however many bytes came.
        `error_response`: the answer to a request the parser refused (aiohttp's own is
        text/plain)."""
        self.app = app
        self.error_response = error_response
        self.keepalive_timeout = keepalive_timeout
        self.listen = listen
        self.reuse_port = reuse_port
        self.ssl_context = ssl_context
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    async def start(self) -> None:
        """Bind `listen`; an OSError (address in use, ...) is the caller's to report."""
        # No access log: the application logs what matters (a queued message, a refusal).
        runner = _Runner(
            self.app,
            self.error_response,
            access_log=None,
            keepalive_timeout=self.keepalive_timeout,
            shutdown_timeout=SHUTDOWN_TIMEOUT,
        )
        await runner.setup()
        site = web.TCPSite(
            runner,
            self.listen.host,
            self.listen.port,
            ssl_context=self.ssl_context,
            backlog=1024,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        assert self._runner is not None and self._runner.addresses
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is None:
            return
        runner, self._runner, self._site = self._runner, None, None
        await runner.cleanup()


class _Runner(web.AppRunner):
    """An AppRunner whose connections answer parser refusals with `error_response`."""

    def __init__(self, app: web.Application, error_response: ErrorResponse | None, **kw: Any):
        super().__init__(app, **kw)
        self._error_response = error_response

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if self._error_response is not None:
            server.__class__ = _Server
            assert isinstance(server, _Server)
            server.error_response = self._error_response
        return server


class _Server(web.Server):
    error_response: ErrorResponse

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Handler(RequestHandler):
    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; checks nothing sent
        manager = self._manager
        if not isinstance(manager, _Server):
            return plain
        response = manager.error_response(status, message or "")
        response.force_close()
        return response
