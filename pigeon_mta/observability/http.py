"""The node's HTTP endpoint on `[metrics] listen`: /metrics, /healthz, /readyz.

A deliberately small HTTP/1.1 server on the supervisor's event loop: GET or HEAD, one request per
connection (`Connection: close`; Prometheus and probes are fine with that). Building the metrics
text reads the workers' files, so it runs in a thread and never stalls the queue maintenance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from http import HTTPStatus

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from pigeon_mta.config import HostPort
from pigeon_mta.observability.exposition import MetricsExposition
from pigeon_mta.observability.health import Readiness

log = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"
REQUEST_TIMEOUT = 10.0  # a client that sends no complete request in this time is dropped
MAX_HEADER_LINES = 100

INDEX = b"pigeon-mta\n/metrics  Prometheus metrics\n/healthz  alive\n/readyz   ready for mail\n"


class ObservabilityServer:
    def __init__(
        self, listen: HostPort, exposition: MetricsExposition, readiness: Readiness
    ) -> None:
        self.listen = listen
        self.exposition = exposition
        self.readiness = readiness
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Bind `listen`; an OSError (address in use, ...) is the caller's to report."""
        self._server = await asyncio.start_server(
            self._handle, self.listen.host, self.listen.port, reuse_address=True
        )

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 5)
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT):
                    method, path = await _read_request(reader)
            except (
                TimeoutError,
                ValueError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ):
                await _respond(writer, "GET", HTTPStatus.BAD_REQUEST, TEXT, b"bad request\n")
                return
            status, content_type, body = await self._route(method, path)
            await _respond(writer, method, status, content_type, body)
        except (ConnectionError, OSError):
            pass  # the client went away; nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _route(self, method: str, path: str) -> tuple[HTTPStatus, str, bytes]:
        if method not in ("GET", "HEAD"):
            return HTTPStatus.METHOD_NOT_ALLOWED, TEXT, b"only GET and HEAD\n"
        if path == "/metrics":
            try:
                body = await asyncio.to_thread(self.exposition.render)
            except Exception:
                log.exception("building /metrics failed")
                return HTTPStatus.INTERNAL_SERVER_ERROR, TEXT, b"metrics failed; see the log\n"
            return HTTPStatus.OK, CONTENT_TYPE_PLAIN_0_0_4, body
        if path == "/healthz":
            return HTTPStatus.OK, TEXT, b"ok\n"
        if path == "/readyz":
            checks = await self.readiness.checks()
            ready = all(c.ok for c in checks)
            text = ("ready\n" if ready else "not ready\n") + "".join(f"{c}\n" for c in checks)
            status = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
            return status, TEXT, text.encode()
        if path == "/":
            return HTTPStatus.OK, TEXT, INDEX
        return HTTPStatus.NOT_FOUND, TEXT, b"not found; try /metrics, /healthz or /readyz\n"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and path of one request; headers are read and ignored."""
    line = (await reader.readuntil(b"\n")).decode("latin-1").strip()
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"not an HTTP request line: {line[:80]!r}")
    for _ in range(MAX_HEADER_LINES):
        if not (await reader.readuntil(b"\n")).strip():
            return parts[0].upper(), parts[1].split("?", 1)[0]
    raise ValueError("too many header lines")


async def _respond(
    writer: asyncio.StreamWriter, method: str, status: HTTPStatus, content_type: str, body: bytes
) -> None:
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    writer.write(head if method == "HEAD" else head + body)
    await writer.drain()
