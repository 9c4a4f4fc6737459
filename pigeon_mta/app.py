"""Composition root for `pigeon-mta serve`: database, maintenance, processes, signals, drain.

One node runs one supervisor. The supervisor locks its data_dir, finds (or starts) the database,
migrates it, creates the trusted org, takes its node name for this run and frees the leases that
the node's earlier runs held when they stopped or died (pigeon_mta/node.py); then it runs the
queue maintenance (lease sweeper, expiry, stats) and the worker processes. With one process the
worker runs inside the supervisor; with several, each is a child process sharing the listening
ports through SO_REUSEPORT. SIGTERM/SIGINT stop claiming, let in-flight work finish within
`server.shutdown_timeout`, release what is left, and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import asyncpg

from pigeon_mta import metrics, node
from pigeon_mta.config import ConfigError, Settings
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.logs import configured_level, setup_logging
from pigeon_mta.observability.exposition import MetricsExposition, MultiprocessSetupError
from pigeon_mta.observability.health import Readiness, publish_queue_stats
from pigeon_mta.observability.http import ObservabilityServer
from pigeon_mta.store import bounces as store_bounces
from pigeon_mta.store import connect as store_connect
from pigeon_mta.store import duplicates as store_duplicates
from pigeon_mta.store import events as store_events
from pigeon_mta.store import migrate as store_migrate
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.notify import NotifySender

log = logging.getLogger("pigeon_mta.serve")


def process_count(settings: Settings, requested: int | None) -> int:
    count = requested if requested is not None else settings.server.processes
    return count if count > 0 else max(1, os.cpu_count() or 1)


async def prepare_database(
    settings: Settings, url: str, run: node.NodeRun, lock: node.DataDirLock
) -> None:
    """Migrate, create the trusted org, take the node name, free the leases of the node's earlier
    runs. Runs once per node start."""
    conn = await store_connect.connect(url, settings)
    try:
        applied = await store_migrate.migrate(conn)
        if applied:
            log.info("schema migrated: %s", ", ".join(f"{m.version:04d}_{m.name}" for m in applied))
        await store_orgs.ensure_org(conn, settings.relay.trusted_org)
        await node.take_node_name(conn, run, lock)
        freed = await store_queue.free_leases_of_gone_runs(
            conn, node_name=run.name, stale_after=node.STALE_AFTER
        )
        if freed:
            log.warning(
                "freed %d recipient(s) that node %s held when it last stopped; they are due again",
                freed,
                run.name,
            )
    finally:
        await conn.close()


# ---------------------------------------------------------------- maintenance


# Expired recipients kept for the delivery log while the database cannot be read, at most.
MAX_UNLOGGED_EXPIRIES = 100_000


@dataclass
class Maintenance:
    """Lease sweeper, expiry, delay warnings, retention and queue stats: cheap periodic queries,
    one set per node."""

    settings: Settings
    pool: asyncpg.Pool
    on_stats: Callable[[store_queue.QueueStats], None] = lambda _s: None
    on_expired: Callable[[list[store_queue.ExpiredRecipient]], Awaitable[None]] | None = None
    last_stats: store_queue.QueueStats | None = None
    healthy: bool = True
    _warned: bool = field(default=False, repr=False)
    # Expired recipients whose delivery-log records are not written yet (the read failed): tried
    # again every round until written, so a database blip does not lose Expiration records.
    _unlogged: list[store_queue.ExpiredRecipient] = field(default_factory=list, repr=False)

    async def run(self, stop: asyncio.Event) -> None:
        delivery = self.settings.delivery
        interval = min(delivery.sweep_interval, self.settings.metrics.stats_interval)
        next_sweep = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            now = loop.time()
            try:
                if now >= next_sweep:
                    await self.sweep_once()
                    next_sweep = now + delivery.sweep_interval
                self.last_stats = await store_queue.queue_stats(self.pool)
                self.on_stats(self.last_stats)
                if not self.healthy:
                    log.info("database reachable again")
                self.healthy = True
            except DB_ERRORS as exc:
                if self.healthy:
                    log.warning("queue maintenance cannot reach the database: %s", exc)
                self.healthy = False
            except Exception:
                # Sweeping, expiry and stats must outlive a bug in one round.
                log.exception("queue maintenance round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def sweep_once(self) -> None:
        requeued = await store_queue.requeue_expired_leases(self.pool)
        if requeued:
            log.warning(
                "lease sweeper: %d recipient(s) whose lease ran out are queued again", requeued
            )
        # Expiry and the DSNs it owes the senders commit together (store.bounces).
        expired = (
            await store_bounces.expire_and_bounce(
                self.pool,
                max_age=self.settings.delivery.max_age,
                max_age_text=format_duration(self.settings.delivery.max_age),
                hostname=self.settings.server.hostname,
            )
        ).recipients
        if expired:
            log.warning("expiry: %d recipient(s) passed delivery.max_age and expired", len(expired))
            if self.on_expired is not None:
                self._unlogged.extend(expired)
                if len(self._unlogged) > MAX_UNLOGGED_EXPIRIES:
                    dropped = len(self._unlogged) - MAX_UNLOGGED_EXPIRIES
                    del self._unlogged[:dropped]
                    log.error(
                        "expiry: %d Expiration record(s) will not reach the delivery log (the "
                        "database has them: pigeon-mta log)",
                        dropped,
                    )
        if self._unlogged and self.on_expired is not None:
            await self.on_expired(self._unlogged)
            self._unlogged = []
        warn_after = self.settings.bounces.delay_warning_after
        if warn_after > 0:
            warned = await store_bounces.warn_delayed(
                self.pool,
                after=warn_after,
                max_age=self.settings.delivery.max_age,
                hostname=self.settings.server.hostname,
            )
            if warned.recipients:
                log.info(
                    "delay warnings: %d recipient(s) still retried after %s; %d warning(s) "
                    "queued for their senders",
                    warned.recipients,
                    format_duration(warn_after),
                    len(warned.warnings),
                )
        keep = self.settings.retention.messages
        if keep > 0:
            purged = await store_queue.purge_finished_messages(self.pool, older_than=keep)
            if purged:
                log.info(
                    "retention: deleted %d finished message(s) older than %s",
                    purged,
                    format_duration(keep),
                )
        # Duplicate-window entries whose window ended; duplicate receptions with their messages.
        await store_duplicates.prune(self.pool, keep_records=keep)


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# ---------------------------------------------------------------- worker


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


def worker_services(
    settings: Settings,
    pool: asyncpg.Pool,
    commit_pool: asyncpg.Pool,
    url: str,
    index: int,
    lease_owner: str,
) -> list[Service]:
    """The services of one worker process, in start order (they stop in reverse order)."""
    from pigeon_mta.outbound.engine import DeliveryEngine
    from pigeon_mta.signer import DkimSigner
    from pigeon_mta.store.notify import QueueWaker

    # Imported here: admin commands import this module and need no SMTP code.
    from pigeon_mta.submission.service import SubmissionService

    delivery_log = DeliveryLog.from_settings(settings)
    signer = DkimSigner.from_settings(pool, settings)
    # One waker per process: the engine waits on it; LISTEN brings mail queued elsewhere, and this
    # process's listeners wake it directly after each commit (NotifySender.poke), which also sends
    # one coalesced NOTIFY for the other processes and nodes when this engine cannot take it all.
    waker = QueueWaker(lambda: store_connect.connect(url, settings))
    engine = (
        DeliveryEngine(
            settings,
            pool,
            sign=signer,
            delivery_log=delivery_log,
            waker=waker,
            lease_owner=lease_owner,
        )
        if settings.delivery.enabled
        else None
    )
    # No NOTIFY for what this process's own engine takes at once (NotifySender).
    notifier = NotifySender(pool, waker, local_takes=engine.takes if engine else None)
    services: list[Service] = [_Resources([signer.close, delivery_log.close], notifier)]
    # The engine stops after the listeners, delivering what they queued.
    if engine is not None:
        services.append(engine)
    elif index == 0:
        log.warning("delivery.enabled is false: this node queues mail but delivers none")
    services.append(
        SubmissionService(
            settings,
            pool,
            delivery_log=delivery_log,
            on_queued=notifier.poke,
            commit_pool=commit_pool,
        )
    )
    return services


# A worker that ran this long before it died is restarted at once, as if it had never failed.
HEALTHY_RUN = 60.0
# The services running in this process, for SIGHUP (reload: TLS certificates, ...).
_RUNNING: list[Service] = []
# The worker processes of this supervisor, for forwarding SIGHUP.
_CHILD_PIDS: set[int] = set()


def reload_services() -> None:
    """SIGHUP: every running service that can reload does, and worker processes are told."""
    log.info("received SIGHUP: reloading")
    for service in _RUNNING:
        reload = getattr(service, "reload", None)
        if reload is not None:
            try:
                reload()
            except Exception:
                log.exception("reloading %s failed", service.name)
    for pid in list(_CHILD_PIDS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)


async def run_worker(
    settings: Settings, url: str, index: int, stop: asyncio.Event, lease_owner: str
) -> None:
    """One serving process: its pools and the services that run in every process. `lease_owner`
    names the node's run (pigeon_mta/node.py)."""
    # The pools close in reverse order, each whatever happens to the other.
    async with contextlib.AsyncExitStack() as pools:
        pool = await store_connect.create_pool(url, settings)
        pools.push_async_callback(pool.close)
        commit_pool = await store_connect.commit_pool(url, settings)
        pools.push_async_callback(commit_pool.close)
        services = worker_services(settings, pool, commit_pool, url, index, lease_owner)
        await _run_services(services, index, stop, settings.server.shutdown_timeout)


async def _run_services(
    services: list[Service], index: int, stop: asyncio.Event, shutdown_timeout: float
) -> None:
    """Start the services in order, run until `stop`, stop them in reverse order, each by
    `shutdown_timeout` seconds after the stop began."""
    started: list[Service] = []
    try:
        for service in services:
            await service.start()
            started.append(service)
            _RUNNING.append(service)
    except BaseException:
        # What already runs (the engine may hold claims) stops cleanly and hands work back.
        deadline = asyncio.get_running_loop().time() + shutdown_timeout
        _RUNNING.clear()
        for service in reversed(started):
            with contextlib.suppress(Exception):
                await service.stop(deadline)
        raise
    log.info("worker %d ready", index)
    metrics.WORKER_STARTS.inc()
    metrics.WORKERS_READY.set(1)
    await stop.wait()
    metrics.WORKERS_READY.set(0)
    deadline = asyncio.get_running_loop().time() + shutdown_timeout
    _RUNNING.clear()
    for service in reversed(started):
        try:
            await service.stop(deadline)
        except Exception:
            log.exception("worker %d: stopping %s failed", index, service.name)


def _worker_process_main(settings: Settings, url: str, index: int, lease_owner: str) -> None:
    _install_child_logging(settings)
    use_uvloop()
    asyncio.run(_worker_process_async(settings, url, index, lease_owner))


def _use_uvloop() -> None:
    """Worker processes start fresh (spawn): choose uvloop here too, as the command line does."""
    if os.environ.get("PIGEON_NO_UVLOOP"):
        return
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def _worker_process_async(settings: Settings, url: str, index: int, lease_owner: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    node.exit_with_supervisor(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_services)
    # The supervisor started this process with SIGHUP blocked (see _supervise_children): one sent
    # before now waited, and is delivered to the handler instead of killing the process.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    await run_worker(settings, url, index, stop, lease_owner)


def _install_child_logging(settings: Settings) -> None:
    setup_logging(configured_level(settings.log.level), settings.log.format)


# ---------------------------------------------------------------- supervisor


async def serve(settings: Settings, *, processes: int | None = None) -> int:
    setup_logging(configured_level(settings.log.level), settings.log.format)
    # Held for the life of this process (the kernel drops it however the process ends).
    with node.data_dir_lock(settings.server.data_dir) as lock:
        run = node.NodeRun(settings.server.node_name)
        lock.record(run)
        return await _serve(settings, processes, run, lock)


async def _serve(
    settings: Settings, processes: int | None, run: node.NodeRun, lock: node.DataDirLock
) -> int:
    from pigeon_mta.config_review import config_warnings, routing_summary

    location = await asyncio.to_thread(store_connect.locate_database, settings)
    log.info("database: %s", location.description)
    for warning in config_warnings(settings):
        log.warning("%s", warning)
    await prepare_database(settings, location.url, run, lock)
    count = process_count(settings, processes)
    log.info(
        "node %s serving with %d process(es) as run %s; config: %s",
        settings.server.node_name,
        count,
        run.lease_owner,
        settings.source,
    )
    log.info("delivery: %s", routing_summary(settings))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    loop.add_signal_handler(signal.SIGHUP, reload_services)

    async with contextlib.AsyncExitStack() as resources:
        pool = await store_connect.create_pool(location.url, settings, size=3)
        resources.push_async_callback(pool.close)
        heartbeat = node.Heartbeat(pool, run, on_displaced=stop)
        heartbeat.start()
        resources.push_async_callback(heartbeat.close)
        exposition = _metrics_exposition(count)  # before any worker process starts
        resources.callback(exposition.close)
        metrics.start_at_zero(lsn.name for lsn in settings.listener)
        delivery_log = _open_delivery_log(settings)
        resources.callback(delivery_log.close)
        readiness = Readiness(
            pool, exposition, [lsn.name for lsn in settings.listener], count, stop
        )
        http = ObservabilityServer(settings.metrics.listen, exposition, readiness)
        await _start_http(http)
        resources.push_async_callback(http.stop)
        maintenance = Maintenance(
            settings,
            pool,
            on_stats=publish_queue_stats,
            on_expired=lambda expired: _log_expiries(pool, delivery_log, expired),
        )
        tasks = [asyncio.create_task(maintenance.run(stop), name="maintenance")]
        if count == 1:
            tasks.append(
                asyncio.create_task(
                    run_worker(settings, location.url, 0, stop, run.lease_owner), name="worker"
                )
            )
        else:
            tasks.append(
                asyncio.create_task(
                    _supervise_children(
                        settings, location.url, count, stop, exposition, run.lease_owner
                    )
                )
            )
        stopper = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if not stop.is_set():
            # A part of the node died on its own (e.g. a listener could not bind): stop the rest
            # and exit non-zero, so that systemd's Restart=on-failure sees it.
            log.error(
                "stopping: %s ended unexpectedly",
                ", ".join(t.get_name() for t in tasks if t.done()),
            )
            stop.set()
        log.info("stopping: draining in-flight work (up to %gs)", settings.server.shutdown_timeout)
        done, pending = await asyncio.wait(tasks, timeout=settings.server.shutdown_timeout + 10)
        stopper.cancel()
        heartbeat.clean_stop = not pending
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                log.error("%s ended with an error: %s", task.get_name(), task.exception())
                if task not in failed:
                    failed.append(task)
    log.info("stopped")
    return 1 if failed or heartbeat.displaced else 0


def _metrics_exposition(count: int) -> MetricsExposition:
    try:
        return MetricsExposition.for_processes(count)
    except MultiprocessSetupError as exc:
        raise ConfigError(str(exc)) from None


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


async def _log_expiries(
    pool: asyncpg.Pool, delivery_log: DeliveryLog, expired: list[store_queue.ExpiredRecipient]
) -> None:
    """Recipients the sweeper expired: written to the delivery log, and counted. The read comes
    first: if it fails, nothing is counted, and the maintenance loop calls again next round."""
    stories = await store_events.expiry_stories(pool, [e.recipient_id for e in expired])
    metrics.DELIVERIES.labels(outcome="expired").inc(len(expired))
    delivery_log.stories(stories)


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()


async def _supervise_children(
    settings: Settings,
    url: str,
    count: int,
    stop: asyncio.Event,
    exposition: MetricsExposition,
    lease_owner: str,
) -> None:
    """Run `count` worker processes; restart one that dies; on stop, SIGTERM all and wait."""
    ctx = multiprocessing.get_context("spawn")
    children: dict[int, multiprocessing.process.BaseProcess] = {}
    started_at: dict[int, float] = {}

    def start(index: int) -> None:
        proc = ctx.Process(
            target=_worker_process_main,
            args=(settings, url, index, lease_owner),
            name=f"pigeon-worker-{index}",
            daemon=False,
        )
        # A SIGHUP forwarded before the new process has installed its handler would kill it
        # (the default action): it starts with SIGHUP blocked, inherited across fork and exec,
        # and unblocks it once its handler is in place.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        started_at[index] = loop_time()
        children[index] = proc
        if proc.pid is not None:
            exposition.worker_started(index, proc.pid)
            _CHILD_PIDS.add(proc.pid)
        log.info("started worker %d (pid %s)", index, proc.pid)

    for i in range(count):
        start(i)
    # A worker that keeps dying (say, its listener cannot bind) is restarted after a growing pause,
    # so that it does not claim and abandon a batch every second.
    failures: dict[int, int] = {}
    restart_at: dict[int, float] = {}
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        now = loop_time()
        for index, proc in list(children.items()):
            if stop.is_set() or proc.is_alive():
                continue
            if index not in restart_at:
                if now - started_at.get(index, now) >= HEALTHY_RUN:
                    failures[index] = 0  # it had been running well: this is a new story
                failures[index] = failures.get(index, 0) + 1
                pause = min(60.0, 2.0 ** (failures[index] - 1)) if failures[index] > 1 else 0.0
                restart_at[index] = now + pause
                log.error(
                    "worker %d (pid %s) exited with %s; restarting in %gs",
                    index,
                    proc.pid,
                    proc.exitcode,
                    pause,
                )
                if proc.pid is not None:
                    exposition.worker_exited(proc.pid)
                _CHILD_PIDS.discard(proc.pid or 0)
            if now >= restart_at[index]:
                del restart_at[index]
                start(index)
    for proc in children.values():
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGTERM)
    deadline = loop_time() + settings.server.shutdown_timeout + 5
    for proc in children.values():
        while proc.is_alive() and loop_time() < deadline:
            await asyncio.sleep(0.1)
        if proc.is_alive() and proc.pid is not None:
            log.error("worker pid %s did not stop in time; killing it", proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(1)
        if proc.pid is not None:
            exposition.worker_exited(proc.pid)


def use_uvloop() -> None:
    """uvloop where available: the engine costs about 40% less CPU per message with it."""
    if sys.platform == "win32" or os.environ.get("PIGEON_NO_UVLOOP"):
        return
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def loop_time() -> float:
    return asyncio.get_running_loop().time()
