"""The listeners of one worker process, as a `Service`: bind, serve, reload TLS, drain.

Each listener is aiosmtpd's SMTP protocol served from this process's own event loop through
`loop.create_server(..., reuse_port=True)`: every worker process binds the same ports and the
kernel spreads new connections over them. (aiosmtpd's Controller runs a thread per server and
probes its own port on start, which a sibling process may answer: not usable here.)
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from pigeon_mta.config import ListenerSettings, Settings
from pigeon_mta.feedback.listener import FeedbackHandler
from pigeon_mta.feedback.return_paths import ReturnPaths
from pigeon_mta.intake.accept import Intake
from pigeon_mta.metrics import LISTENERS_BOUND
from pigeon_mta.submission import replies
from pigeon_mta.submission.auth import Authenticator
from pigeon_mta.submission.context import ConnectionCounter, ListenerContext
from pigeon_mta.submission.handler import SubmissionHandler
from pigeon_mta.submission.protocol import SMTPSession
from pigeon_mta.submission.tls import listener_tls

log = logging.getLogger("pigeon_mta.submission")


@dataclass(frozen=True)
class Feedback:
    """What a `feedback` listener asks: which domains are return paths, and whom to wake."""

    return_paths: ReturnPaths
    poke: Callable[[], None]


# How often stop() looks whether the sessions with a commit under way have finished.
_DRAIN_POLL = 0.05


class SubmissionService:
    name = "submission"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        intake: Intake | None = None,
        *,
        feedback: Feedback | None = None,
    ) -> None:
        """`intake`: the process's (app.py), shared with the HTTP API; one of the listeners' own
        (`Intake.of`) when not given. `feedback`: what `feedback` listeners need (app.py)."""
        self.settings = settings
        self.pool = pool
        self.intake = intake or Intake.of(settings, pool)
        self.feedback = feedback
        self.authenticator = Authenticator(pool, settings.limits)
        self.connections = ConnectionCounter(settings.limits.max_connections_per_ip)
        self.trusted_networks = tuple(
            ipaddress.ip_network(n, strict=False) for n in settings.relay.trusted_networks
        )
        self.contexts: list[ListenerContext] = []
        self.servers: list[asyncio.Server] = []
        # Where each listener is bound (useful with port 0): name -> (host, port).
        self.bound: dict[str, tuple[str, int]] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            for listener in self.settings.listener:
                await self._start_listener(loop, listener)
        except BaseException:
            await self._close_servers()
            raise

    async def _start_listener(
        self, loop: asyncio.AbstractEventLoop, listener: ListenerSettings
    ) -> None:
        tls = await asyncio.to_thread(listener_tls, self.settings, listener)
        ctx = ListenerContext(
            settings=self.settings,
            listener=listener,
            pool=self.pool,
            tls=tls,
            authenticator=self.authenticator,
            connections=self.connections,
            trusted_networks=self.trusted_networks,
            intake=self.intake,
        )
        handler: SubmissionHandler | FeedbackHandler = SubmissionHandler(ctx)
        if listener.mode == "feedback":
            if self.feedback is None:
                raise RuntimeError(f"listener {listener.name}: feedback mode needs a processor")
            handler = FeedbackHandler(
                ctx,
                self.feedback.return_paths,
                self.settings.bounces.complaint_addresses,
                self.feedback.poke,
            )
        try:
            server = await loop.create_server(
                lambda: SMTPSession(handler, ctx),
                host=listener.address.host,
                port=listener.address.port,
                reuse_port=True,
                ssl=tls.front_context() if listener.mode == "submissions" else None,
                backlog=1024,
            )
        except OSError as exc:
            raise RuntimeError(
                f"listener {listener.name} cannot bind {listener.address}: {exc.strerror or exc}"
            ) from None
        self.contexts.append(ctx)
        self.servers.append(server)
        host, port = server.sockets[0].getsockname()[:2]
        self.bound[listener.name] = (host, port)
        LISTENERS_BOUND.labels(listener=listener.name).set(1)
        log.info(
            "listener %s bound on %s (%s)",
            listener.name,
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            listener.mode,
        )

    def reload(self) -> None:
        """SIGHUP: load every listener's certificate again."""
        for ctx in self.contexts:
            ctx.tls.reload()

    async def stop(self, deadline: float) -> None:
        """Stop accepting; let commits under way finish (until `deadline`), then hang up on all."""
        loop = asyncio.get_running_loop()
        for ctx in self.contexts:
            ctx.shutting_down = True
            LISTENERS_BOUND.labels(listener=ctx.name).set(0)
        for server in self.servers:
            server.close()
        while loop.time() < deadline:
            pending = False
            for ctx in self.contexts:
                for session in list(ctx.sessions):
                    if session.enqueuing:
                        pending = True
                    else:
                        session.close_with(replies.SHUTTING_DOWN)
            if not pending:
                break
            await asyncio.sleep(_DRAIN_POLL)
        for ctx in self.contexts:
            for session in list(ctx.sessions):
                session.close_with(replies.SHUTTING_DOWN)
        await self._close_servers()

    async def _close_servers(self) -> None:
        for server in self.servers:
            server.close()
        for server in self.servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 5)
            except TimeoutError:
                log.warning("a listener did not close within 5s")
        self.servers.clear()
