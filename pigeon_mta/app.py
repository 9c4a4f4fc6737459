"""Composition root of `pigeon-mta serve`: the parts a node and each of its worker processes run
(pigeon_mta/supervisor.py decides which process runs them, and when they stop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import asyncpg

from pigeon_mta import metrics, node
from pigeon_mta.config import API_LISTENER, Settings
from pigeon_mta.config_loader import ConfigError
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.observability.exposition import MetricsExposition, MultiprocessSetupError
from pigeon_mta.observability.health import Readiness
from pigeon_mta.observability.http import ObservabilityServer
from pigeon_mta.store import connect as store_connect
from pigeon_mta.store.notify import NotifySender

log = logging.getLogger("pigeon_mta.serve")


@dataclass
class NodeParts:
    """What one node runs once, whatever its number of worker processes."""

    pool: asyncpg.Pool
    heartbeat: node.Heartbeat
    exposition: MetricsExposition
    delivery_log: DeliveryLog


@contextlib.asynccontextmanager
async def node_parts(
    settings: Settings, url: str, run: node.NodeRun, count: int, stop: asyncio.Event
) -> AsyncIterator[NodeParts]:
    """The node's parts for `count` worker processes; `stop` is set if another run takes over."""
    async with contextlib.AsyncExitStack() as resources:
        pool = await store_connect.create_pool(url, settings, size=3)
        resources.push_async_callback(pool.close)
        heartbeat = node.Heartbeat(pool, run, on_displaced=stop)
        heartbeat.start()
        resources.push_async_callback(heartbeat.close)
        try:
            exposition = MetricsExposition.for_processes(count)  # before any worker process starts
        except MultiprocessSetupError as exc:
            raise ConfigError(str(exc)) from None
        resources.callback(exposition.close)
        listeners = [lsn.name for lsn in settings.listener]
        metrics.start_at_zero(listeners)
        delivery_log = _open_delivery_log(settings)
        resources.callback(delivery_log.close)
        # The API's listener is one more that must be bound for the node to be ready.
        bound = [*listeners, API_LISTENER] if settings.api.listen is not None else listeners
        outboxes = [o.name for o in settings.outbox]
        readiness = Readiness(pool, exposition, bound, count, stop, outboxes)
        http = ObservabilityServer(settings.metrics.listen, exposition, readiness)
        await _start_http(http)
        resources.push_async_callback(http.stop)
        yield NodeParts(pool, heartbeat, exposition, delivery_log)


def _open_delivery_log(settings: Settings) -> DeliveryLog:
    try:
        delivery_log = DeliveryLog.from_settings(settings)
    except OSError as exc:
        raise ConfigError(
            f"cannot open 'log.delivery_log' {settings.log.delivery_log}: {exc.strerror}"
        ) from None
    log.info("delivery log: %s", delivery_log.description)
    return delivery_log


async def _start_http(http: ObservabilityServer) -> None:
    try:
        await http.start()
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on 'metrics.listen' {http.listen}: {exc.strerror or exc}"
        ) from None
    log.info(
        "metrics and health on http://%s:%d (/metrics, /healthz, /readyz)",
        http.listen.host if ":" not in http.listen.host else f"[{http.listen.host}]",
        http.port,
    )


class Service(Protocol):
    """Something every worker process runs: a listener set, the delivery engine, ..."""

    name: str

    async def start(self) -> None:
        """Bind / begin work. Raising aborts the worker's start-up."""

    async def stop(self, deadline: float) -> None:
        """Stop taking new work; finish in-flight work by `deadline` (loop time); release the rest."""


@dataclass
class _Resources:
    """Per-process resources shared by the services; first to start, last to stop."""

    closers: list[Callable[[], None]]
    notifier: NotifySender
    name: str = "resources"

    async def start(self) -> None:
        self.notifier.start()

    async def stop(self, deadline: float) -> None:
        await self.notifier.close()
        for close in self.closers:
            close()


@contextlib.asynccontextmanager
async def worker_services(
    settings: Settings, url: str, index: int, lease_owner: str
) -> AsyncIterator[list[Service]]:
    """The services of one worker process in start order (they stop in reverse order), its pools
    open while they run. `lease_owner` names the node's run (pigeon_mta/node.py)."""
    # Imported here: admin commands import this module and need no SMTP or HTTP code.
    from pigeon_mta.api.server import ApiService
    from pigeon_mta.feedback.processor import FeedbackProcessor
    from pigeon_mta.feedback.return_paths import ReturnPaths
    from pigeon_mta.intake.accept import Intake
    from pigeon_mta.outbound.engine import DeliveryEngine
    from pigeon_mta.outbox.relay import OutboxRelay
    from pigeon_mta.signer import DkimSigner
    from pigeon_mta.store.notify import QueueWaker
    from pigeon_mta.submission.service import Feedback, SubmissionService
    from pigeon_mta.webhooks.sender import WebhookSender

    async with contextlib.AsyncExitStack() as stack:
        pools = await store_connect.worker_pools(url, settings, stack)
        pool, commit_pool, record_pool = pools.main, pools.commits, pools.records
        delivery_log = DeliveryLog.from_settings(settings)
        signer = DkimSigner.from_settings(pool, settings)
        # One waker per process: the engine waits on it; LISTEN brings mail queued elsewhere. The
        # group commit hands this engine what it has room for, else wakes it (NotifySender.poke,
        # with one coalesced NOTIFY for the others when this engine cannot take all).
        waker = QueueWaker(lambda: store_connect.connect(url, settings))
        # Handed the events of this process's outcomes by the record (outbound/recorder.py), it
        # claims from the outbox only what others wrote or left there.
        webhooks = WebhookSender(settings.webhooks, pool)
        # Return-path domains and VERP keys: the engine's envelope senders, the feedback
        # listeners' domains (feedback/return_paths.py).
        return_paths = ReturnPaths(settings, pool)
        engine = None
        if settings.delivery.enabled:
            engine = DeliveryEngine(
                settings,
                pool,
                sign=signer,
                delivery_log=delivery_log,
                waker=waker,
                lease_owner=lease_owner,
                record_pool=record_pool,
                webhooks=webhooks,
                senders=return_paths.split,
            )
        # No NOTIFY for what this process's own engine takes at once (NotifySender).
        notifier = NotifySender(pool, waker, local_takes=engine.takes if engine else None)
        services: list[Service] = [
            _Resources([signer.close, delivery_log.close], notifier),
            return_paths,
        ]
        # The webhook sender stops after the engine, sending the events of its last outcomes;
        # it holds its own slots per endpoint and never waits on the engine (webhooks/sender.py).
        services.append(webhooks)
        # The engine stops after the listeners, delivering what they queued.
        if engine is not None:
            services.append(engine)
        elif index == 0:
            log.warning("delivery.enabled is false: this node queues mail but delivers none")
        # One intake for every door: the listeners' and the API's messages share commits, which
        # hand them to this process's engine or wake the engines.
        intake = Intake.of(
            settings,
            pool,
            commit_pool=commit_pool,
            engine=engine,
            on_queued=notifier.poke,
            delivery_log=delivery_log,
        )
        # With a feedback listener, a processor reads what it keeps (feedback/processor.py).
        processor = FeedbackProcessor.of(settings, pool, return_paths)
        services.extend([processor] if processor else [])
        feedback = Feedback(return_paths, processor.poke) if processor else None
        services.append(SubmissionService(settings, pool, intake, feedback=feedback))
        if settings.api.listen is not None:
            services.append(ApiService(settings, pool, intake))
        elif index == 0:
            log.info("HTTP API off ('api.listen' is empty)")
        # Each outbox's relay is one more door to the intake (outbox/relay.py).
        services.extend(OutboxRelay(settings, o, pool, intake) for o in settings.outbox)
        yield services
