"""The node's HTTP endpoint on `[metrics] listen`: /metrics, /healthz, /readyz.

An aiohttp application (pigeon_mta/web.py serves it) on the supervisor's event loop: GET or HEAD.
Building the metrics text reads the workers' files, so it runs in a thread and never stalls the
queue maintenance.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from pigeon_mta.config import HostPort
from pigeon_mta.observability.exposition import MetricsExposition
from pigeon_mta.observability.health import Readiness
from pigeon_mta.web import WebServer

log = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"

INDEX = b"pigeon-mta\n/metrics  Prometheus metrics\n/healthz  alive\n/readyz   ready for mail\n"


class ObservabilityServer(WebServer):
    def __init__(
        self, listen: HostPort, exposition: MetricsExposition, readiness: Readiness
    ) -> None:
        self.exposition = exposition
        self.readiness = readiness
        app = web.Application()
        # GET routes answer HEAD too (aiohttp drops the body and keeps Content-Length).
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/", self._index)
        app.router.add_route("*", "/{path:.*}", self._other)
        super().__init__(app, listen)

    async def _metrics(self, _request: web.Request) -> web.Response:
        try:
            body = await asyncio.to_thread(self.exposition.render)
        except Exception:
            log.exception("building /metrics failed")
            return _answer(500, TEXT, b"metrics failed; see the log\n")
        return _answer(200, CONTENT_TYPE_PLAIN_0_0_4, body)

    async def _healthz(self, _request: web.Request) -> web.Response:
        return _answer(200, TEXT, b"ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        checks = await self.readiness.checks()
        ready = all(c.ok or not c.required for c in checks)
        text = ("ready\n" if ready else "not ready\n") + "".join(f"{c}\n" for c in checks)
        return _answer(200 if ready else 503, TEXT, text.encode())

    async def _index(self, _request: web.Request) -> web.Response:
        return _answer(200, TEXT, INDEX)

    async def _other(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return _answer(405, TEXT, b"only GET and HEAD\n")
        return _answer(404, TEXT, b"not found; try /metrics, /healthz or /readyz\n")


def _answer(status: int, content_type: str, body: bytes) -> web.Response:
    response = web.Response(status=status, body=body)
    # Set as a header: aiohttp's content_type would add its own charset parameter.
    response.headers["Content-Type"] = content_type
    response.headers["Cache-Control"] = "no-store"
    return response
