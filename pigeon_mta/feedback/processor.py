"""The feedback processor: reads what the feedback listeners kept, and records what it says.

A batch of unread feedback messages is taken FOR UPDATE SKIP LOCKED (each worker process runs
one; two never take the same message), their reports read off the event loop
(feedback/parse.py), matched to the recipients they name (feedback/apply.py) and recorded with
what became of each message, all in the transaction that took them (store/feedback.py), with,
under `[bounces] forward_to_sender`, a DSN to the original sender of each recipient a report
bounced (dsn_queue.py, as for a synchronous bounce): a processor that dies half-way leaves them
unread for the next. The listener of this process wakes
it after each message it keeps; it also looks every `poll` seconds for what others kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.dsn_queue import queue_bounces
from pigeon_mta.feedback.apply import Read, match
from pigeon_mta.feedback.parse import read_report
from pigeon_mta.feedback.return_paths import ReturnPaths
from pigeon_mta.metrics import FEEDBACK
from pigeon_mta.outbound.room import finish_task
from pigeon_mta.store import feedback as store_feedback
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.executor import transaction

log = logging.getLogger("pigeon_mta.feedback")

BATCH = 200
POLL = 2.0


class FeedbackProcessor:
    name = "feedback"

    def __init__(
        self,
        pool: asyncpg.Pool,
        return_paths: ReturnPaths,
        *,
        batch: int = BATCH,
        poll: float = POLL,
        forward_to: str | None = None,
    ) -> None:
        """`forward_to`: the host name DSNs come from, to tell the original senders of the
        recipients a report bounced (`[bounces] forward_to_sender`); None tells nobody."""
        self.pool = pool
        self.forward_to = forward_to
        self.return_paths = return_paths
        self.batch = batch
        self.poll = poll
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    def of(
        cls, settings: Settings, pool: asyncpg.Pool, return_paths: ReturnPaths
    ) -> FeedbackProcessor | None:
        """The processor of a worker whose node has a feedback listener, else None."""
        if not return_paths.verifies:
            return None
        forward = settings.server.hostname if settings.bounces.forward_to_sender else None
        return cls(pool, return_paths, forward_to=forward)

    def poke(self) -> None:
        """Something was kept: read it now."""
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="feedback")

    async def stop(self, deadline: float) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await finish_task(self._task, deadline - asyncio.get_running_loop().time())

    async def _run(self) -> None:
        while not self._stopping:
            try:
                done = await self.process()
            except DB_ERRORS as exc:
                log.warning("feedback not processed, trying again: %s", exc)
                done = 0
            except Exception:
                log.exception("feedback processing failed unexpectedly")
                done = 0
            if done >= self.batch:
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll)

    async def process(self) -> int:
        """One batch; returns how many feedback messages it read."""
        async with transaction(self.pool) as conn:
            unread = await store_feedback.take_new(conn, self.batch)
            if not unread:
                return 0
            reports = await asyncio.to_thread(lambda: [read_report(u.body) for u in unread])
            reads = [Read(u.id, u.rcpt_to, r) for u, r in zip(unread, reports, strict=True)]
            found = await match(conn, reads, self.return_paths.verifying())
            recorded = await store_feedback.record(
                conn,
                [e for f in found for e in f.events],
                [f.outcome for f in found],
            )
            forwarded = []
            if self.forward_to is not None and recorded.moved:
                # In the same transaction, as for a bounce the engine records (dsn_queue.py).
                forwarded = await queue_bounces(conn, recorded.moved, hostname=self.forward_to)
        for f in found:
            if f.outcome.status == store_feedback.NEW:
                log.debug("feedback %s: %s", f.outcome.feedback_id, f.outcome.detail)
                continue
            FEEDBACK.labels(kind=f.outcome.kind or "unknown", outcome=f.outcome.status).inc()
            log.info(
                "feedback %s: %s (%s)", f.outcome.feedback_id, f.outcome.status, f.outcome.detail
            )
        if recorded.events:
            log.info(
                "feedback: %d event(s), %d recipient(s) now bounced, %d address(es) suppressed, "
                "%d DSN(s) to their senders",
                recorded.events,
                len(recorded.moved),
                recorded.suppressed,
                len(forwarded),
            )
        return len(unread)
