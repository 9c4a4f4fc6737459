"""Serving an aiohttp application on one `host:port`: the one HTTP server of a node.

The metrics endpoint (observability/http.py) and the HTTP API (api/server.py) are each an aiohttp
`Application`; `WebServer` binds it, says where, and stops it. The API is bound by every worker
process on the same port (`reuse_port`, as the SMTP listeners are: the kernel spreads new
connections over the processes).
"""

from __future__ import annotations

import ssl

from aiohttp import web

from pigeon_mta.config import HostPort

# A client whose keep-alive connection stays idle this long is closed.
KEEPALIVE_TIMEOUT = 75.0
# How long stop() lets requests under way finish.
SHUTDOWN_TIMEOUT = 5.0


class WebServer:
    def __init__(
        self,
        app: web.Application,
        listen: HostPort,
        *,
        reuse_port: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> None:
        """`keepalive_timeout` also bounds the wait for a request's line and header fields:
        aiohttp arms it when a connection opens and after each answer, and closes a connection
        still waiting for a whole request head when it runs out, however many bytes came."""
        self.app = app
        self.keepalive_timeout = keepalive_timeout
        self.listen = listen
        self.reuse_port = reuse_port
        self.ssl_context = ssl_context
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    async def start(self) -> None:
        """Bind `listen`; an OSError (address in use, ...) is the caller's to report."""
        # No access log: the application logs what matters (a queued message, a refusal).
        runner = web.AppRunner(
            self.app,
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
