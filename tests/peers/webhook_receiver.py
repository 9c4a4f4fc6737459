"""A webhook receiver on loopback: a real aiohttp server that keeps every request it is sent.

    pigeon-mta (sender) --HTTP POST--> WebhookReceiver 127.0.0.1:<port>

`answer` chooses the reply: "ok" (204), "fail" (500), or "stall" (no reply for `stall_seconds`,
as a stuck application does). Each request is kept with its headers and body, and whether its
Standard Webhooks signature verifies with the `standardwebhooks` package, an independent
verifier, when the receiver knows the secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass
class ReceivedRequest:
    headers: dict[str, str]
    body: bytes
    verified: bool | None  # None: no secret to check with

    @property
    def event(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]


@dataclass
class WebhookReceiver:
    answer: Literal["ok", "fail", "stall"] = "ok"
    secret: str | None = None
    stall_seconds: float = 30.0
    requests: list[ReceivedRequest] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    port: int = 0

    async def start(self, port: int = 0) -> int:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        verified = None
        if self.secret is not None:
            try:
                Webhook(self.secret).verify(body, headers)
                verified = True
            except WebhookVerificationError:
                verified = False
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.changed.set()
        try:
            if self.answer == "stall":
                await asyncio.sleep(self.stall_seconds)
            self.requests.append(ReceivedRequest(headers, body, verified))
            self.changed.set()
            if self.answer == "fail":
                return web.Response(status=500, text="no thanks")
            return web.Response(status=204)
        finally:
            self.in_flight -= 1

    async def wait_for(self, predicate: Any, timeout: float = 60) -> None:
        """Wait until predicate() is true (checked whenever a request comes or is answered)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"receiver condition not met within {timeout}s "
                    f"({len(self.requests)} request(s) answered, {self.in_flight} in flight)"
                )
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.2))

    def events(self) -> list[dict[str, Any]]:
        return [r.event for r in self.requests]
