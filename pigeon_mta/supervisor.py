"""Processes and signals of `pigeon-mta serve`: the worker processes, SIGTERM/SIGINT/SIGHUP, drain.

One node runs one supervisor. The supervisor locks its data_dir, makes sure that no other process
listens on the ports its workers share (pigeon_mta/ports.py), finds (or starts) the database and
prepares it (pigeon_mta/app.py, pigeon_mta/node.py); then it runs the queue maintenance
(pigeon_mta/maintenance.py) and the worker processes. With one process the worker runs inside the
supervisor; with several, each is a child process sharing the listening ports through SO_REUSEPORT.
SIGTERM/SIGINT stop claiming, let in-flight work finish within `server.shutdown_timeout`, release
what is left, and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field

from pigeon_mta import app, metrics, node, node_start, ports
from pigeon_mta.app import Service
from pigeon_mta.config import Settings
from pigeon_mta.logs import configured_level, setup_logging
from pigeon_mta.maintenance import Maintenance, log_expiries
from pigeon_mta.observability.exposition import MetricsExposition
from pigeon_mta.observability.health import QueueGauges
from pigeon_mta.store import connect as store_connect

log = logging.getLogger("pigeon_mta.serve")

# A worker that ran this long before it died is restarted at once, as if it had never failed.
HEALTHY_RUN = 60.0


def use_uvloop() -> None:
    """uvloop where available: the engine costs about 40% less CPU per message with it. Worker
    processes start fresh (spawn) and choose it again."""
    if sys.platform == "win32" or os.environ.get("PIGEON_NO_UVLOOP"):
        return
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def process_count(settings: Settings, requested: int | None) -> int:
    count = requested if requested is not None else settings.server.processes
    return count if count > 0 else max(1, os.cpu_count() or 1)


async def serve(settings: Settings, *, processes: int | None = None) -> int:
    setup_logging(configured_level(settings.log.level), settings.log.format)
    # Held for the life of this process (the kernel drops it however the process ends).
    with node.data_dir_lock(settings.server.data_dir) as lock:
        # Before anything starts: another process listening on a shared port would get a share
        # of this node's clients without a word (pigeon_mta/ports.py).
        await asyncio.to_thread(ports.refuse_if_taken, settings)
        run = node.NodeRun(settings.server.node_name)
        lock.record(run)
        return await Supervisor(settings).serve(processes, run, lock)


@dataclass
class Supervisor:
    """One process's share of `serve`: the services it runs and the worker processes it started,
    which its signal handlers reach. Each worker process has its own, with no children."""

    settings: Settings
    # The services running in this process, for SIGHUP (reload: TLS certificates, ...).
    running: list[Service] = field(default_factory=list)
    # The worker processes of this supervisor, for forwarding SIGHUP.
    child_pids: set[int] = field(default_factory=set)

    async def serve(self, processes: int | None, run: node.NodeRun, lock: node.DataDirLock) -> int:
        """Run the node until SIGTERM/SIGINT, or until a part of it ends on its own; the exit
        status (0: a clean stop)."""
        settings = self.settings
        url, count = await self._start(processes, run, lock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig, stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

        async with app.node_parts(settings, url, run, count, stop) as parts:
            maintenance = Maintenance(
                settings,
                parts.pool,
                on_stats=QueueGauges(settings.lanes),
                on_expired=lambda expired: log_expiries(parts.pool, parts.delivery_log, expired),
            )
            tasks = [asyncio.create_task(maintenance.run(stop), name="maintenance")]
            if count == 1:
                tasks.append(
                    asyncio.create_task(
                        self.run_worker(url, 0, stop, run.lease_owner), name="worker"
                    )
                )
            else:
                tasks.append(
                    asyncio.create_task(
                        self.supervise_children(url, count, stop, parts.exposition, run.lease_owner)
                    )
                )
            failed, parts.heartbeat.clean_stop = await self._until_stopped(tasks, stop)
        log.info("stopped")
        return 1 if failed or parts.heartbeat.displaced else 0

    async def _start(
        self, processes: int | None, run: node.NodeRun, lock: node.DataDirLock
    ) -> tuple[str, int]:
        """Find and prepare the database, say what this run serves; its URL and process count."""
        from pigeon_mta.config_review import config_warnings, routing_summary

        settings = self.settings
        location = await asyncio.to_thread(store_connect.locate_database, settings)
        log.info("database: %s", location.description)
        for warning in config_warnings(settings):
            log.warning("%s", warning)
        await node_start.prepare_database(settings, location.url, run, lock)
        count = process_count(settings, processes)
        log.info(
            "node %s serving with %d process(es) as run %s; config: %s",
            settings.server.node_name,
            count,
            run.lease_owner,
            settings.source,
        )
        log.info("delivery: %s", routing_summary(settings))
        return location.url, count

    async def _until_stopped(
        self, tasks: list[asyncio.Task[None]], stop: asyncio.Event
    ) -> tuple[bool, bool]:
        """Wait for `stop`, or for a task to end on its own, then drain the tasks: whether one
        failed, and whether all ended within the drain time."""
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
        timeout = self.settings.server.shutdown_timeout
        log.info("stopping: draining in-flight work (up to %gs)", timeout)
        done, pending = await asyncio.wait(tasks, timeout=timeout + 10)
        stopper.cancel()
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                log.error("%s ended with an error: %s", task.get_name(), task.exception())
                if task not in failed:
                    failed.append(task)
        return bool(failed), not pending

    def on_signal(self, sig: signal.Signals, stop: asyncio.Event) -> None:
        log.info("received %s", sig.name)
        stop.set()

    def reload(self) -> None:
        """SIGHUP: every running service that can reload does, and worker processes are told."""
        log.info("received SIGHUP: reloading")
        for service in self.running:
            reload = getattr(service, "reload", None)
            if reload is not None:
                try:
                    reload()
                except Exception:
                    log.exception("reloading %s failed", service.name)
        for pid in list(self.child_pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    async def run_worker(self, url: str, index: int, stop: asyncio.Event, lease_owner: str) -> None:
        """One serving process's services, from start until `stop`. `lease_owner` names the
        node's run (pigeon_mta/node.py)."""
        async with app.worker_services(self.settings, url, index, lease_owner) as services:
            await self._run_services(services, index, stop, self.settings.server.shutdown_timeout)

    async def _run_services(
        self, services: list[Service], index: int, stop: asyncio.Event, shutdown_timeout: float
    ) -> None:
        """Start the services in order, run until `stop`, stop them in reverse order, each by
        `shutdown_timeout` seconds after the stop began."""
        started: list[Service] = []
        try:
            for service in services:
                await service.start()
                started.append(service)
                self.running.append(service)
        except BaseException:
            # What already runs (the engine may hold claims) stops cleanly and hands work back.
            deadline = asyncio.get_running_loop().time() + shutdown_timeout
            self.running.clear()
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
        self.running.clear()
        for service in reversed(started):
            try:
                await service.stop(deadline)
            except Exception:
                log.exception("worker %d: stopping %s failed", index, service.name)

    async def run_worker_process(self, url: str, index: int, lease_owner: str) -> None:
        """A worker child process: its signal handlers, then its services until SIGTERM."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        node.exit_with_supervisor(loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        # The supervisor started this process with SIGHUP blocked (see supervise_children): one
        # sent before now waited, and is delivered to the handler instead of killing the process.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        await self.run_worker(url, index, stop, lease_owner)

    async def supervise_children(
        self,
        url: str,
        count: int,
        stop: asyncio.Event,
        exposition: MetricsExposition,
        lease_owner: str,
    ) -> None:
        """Run `count` worker processes; restart one that dies; on stop, SIGTERM all and wait."""
        settings = self.settings
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
                self.child_pids.add(proc.pid)
            log.info("started worker %d (pid %s)", index, proc.pid)

        for i in range(count):
            start(i)
        # A worker that keeps dying (say, its listener cannot bind) is restarted after a growing
        # pause, so that it does not claim and abandon a batch every second.
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
                    self.child_pids.discard(proc.pid or 0)
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


def _worker_process_main(settings: Settings, url: str, index: int, lease_owner: str) -> None:
    """Entry point of a spawned worker process: it starts with nothing of its parent's set up."""
    _install_child_logging(settings)
    use_uvloop()
    asyncio.run(Supervisor(settings).run_worker_process(url, index, lease_owner))


def _install_child_logging(settings: Settings) -> None:
    setup_logging(configured_level(settings.log.level), settings.log.format)


def loop_time() -> float:
    return asyncio.get_running_loop().time()
