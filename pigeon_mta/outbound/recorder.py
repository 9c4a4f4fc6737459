"""The engine's record stage: results wait here and are recorded in batches, one transaction each.

Each batch goes through `apply_outcomes` (outbound/apply.py); what took effect is counted, and
the delivery log gets its records after the commit (the same events are in the database). The
process's webhook sender offers each batch its free room, and gets the webhook events written
within it after the commit, already claimed for it (webhooks/sender.py).

What a failed record means decides what happens to its batch. A failure that is about something
in it (`is_about_the_values`: a reply no DSN can carry, a value the database refuses) would fail
again for ever, holding every other outcome of the process with it. So the batch is split in halves until the result that fails is alone;
that one is recorded plain (outcome.plain_result: ASCII, bounded, its reason in the text), else
without its DSN, else dropped with an error in the log; the rest of the batch is recorded as it
is. Any other failure (the database away, a privilege revoked, a function missing) would fail
every result alike: the batch is kept and tried again, since dropping it would send the mail again
once its leases ran out. A recorder whose results wait longer than `STALL_AFTER` without any being recorded counts
itself in `pigeon_recorders_stalled`, and the node is not ready (observability/health.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Sequence, Set
from datetime import UTC, datetime
from typing import Protocol

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.metrics import DELIVERIES, RECORD_FAILURES, RECORDER_PENDING, RECORDERS_STALLED
from pigeon_mta.model import AttemptResult, Delivery
from pigeon_mta.outbound.apply import apply_outcomes
from pigeon_mta.outbound.claims import Claims
from pigeon_mta.outbound.outcome import interrupted_after_data, plain_result
from pigeon_mta.plain import plain_error, plain_text
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.errors import is_about_the_values
from pigeon_mta.store.webhooks import NO_OFFER, ClaimedEvent, Offer

log = logging.getLogger(__name__)

# Results recorded in one statement at most; a busy engine records in batches of up to this.
RECORD_BATCH = 1000
# Seconds results may wait with none recorded before the recorder says it is stalled.
STALL_AFTER = 30.0
# Seconds between two tries of a batch while the database is away.
RETRY_AFTER = 1.0


class EventHandoff(Protocol):
    """A webhook sender that takes the new events of recorded outcomes from the record itself."""

    async def offer(self) -> Offer:
        """The room to write new events claimed for this sender in, held until `take`."""
        ...

    def take(self, offer: Offer, events: Sequence[ClaimedEvent], waiting: Set[uuid.UUID]) -> None:
        """After the record: the events written claimed within `offer` (none if the record
        failed), and the webhooks with new events waiting in the outbox for a claim."""
        ...


class Recorder:
    """Results submitted by the engine's deliveries, and the loop (`run`) that records them."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        settings: Settings,
        claims: Claims,
        delivery_log: DeliveryLog,
        webhooks: EventHandoff | None = None,
        *,
        stall_after: float = STALL_AFTER,
    ) -> None:
        self.pool = pool
        self.stall_after = stall_after
        self.settings = settings
        self.claims = claims
        self.delivery_log = delivery_log
        self.webhooks = webhooks
        self._pending: list[AttemptResult] = []
        self._pending_event = asyncio.Event()
        self._finishing = False
        # When the oldest pending result came (on the event loop's clock), at the latest.
        self._since = 0.0
        # When results last were recorded, or began to wait with none pending before: the
        # recorder is stalled when results wait and this is older than STALL_AFTER.
        self._progress_at: float | None = None
        self._stalled = False

    def submit(self, results: Sequence[AttemptResult]) -> None:
        self.claims.judged(results)
        if not self._pending:
            self._progress_at = asyncio.get_running_loop().time()
        self._pending.extend(results)
        RECORDER_PENDING.set(len(self._pending))
        self._pending_event.set()

    def finish(self) -> None:
        """`run` records what is pending (one try each) and returns."""
        self._finishing = True
        self._pending_event.set()

    async def record_rest(self, extra: Sequence[AttemptResult]) -> None:
        """At stop, after `run` returned: record what is still pending and `extra` at once. A
        database error is raised, and the results stay pending."""
        final = [*self._pending, *extra]
        if final:
            done, error = await self.record_isolating(final)
            for result in final[:done]:
                self.claims.forget(result)
            if error is not None:
                del self._pending[: min(done, len(self._pending))]
                raise error
        self._pending.clear()
        RECORDER_PENDING.set(0)

    async def hand_back(self) -> None:
        """At stop: what finished is recorded, and everything still claimed goes back to the
        queue now. A transaction broken off after its final dot is recorded as deferred, a
        possible duplicate, rather than released as if it had never been tried."""
        if not self.claims:
            return
        now = datetime.now(UTC)
        interrupted = [interrupted_after_data(d, r, now) for d, r in self.claims.sent_unjudged()]
        try:
            await self.record_rest(interrupted)
            released = await self.claims.release_all()
        except DB_ERRORS as exc:
            log.error(
                "delivery engine: could not hand back %d claimed recipient(s) (%s); they return "
                "to the queue when their lease runs out",
                len(self.claims),
                exc,
            )
            return
        if released:
            log.info("delivery engine: %d unfinished recipient(s) are queued again", released)

    async def record_isolating(
        self, batch: Sequence[AttemptResult]
    ) -> tuple[int, BaseException | None]:
        """Record `batch`, split around the results that cannot be recorded as they are (see the
        module's docstring). Returns how many of the batch, from its start, are done (recorded,
        or dropped), and the database error that stopped the rest (None: all are done)."""
        parts: list[Sequence[AttemptResult]] = [batch]
        done = 0
        while parts:
            part = parts.pop(0)
            try:
                await self.record(part)
            except Exception as exc:
                if not is_about_the_values(exc):
                    return done, exc
                if len(part) > 1:
                    middle = len(part) // 2
                    parts[0:0] = [part[:middle], part[middle:]]
                    continue
                try:
                    await self._record_alone(part[0], exc)
                except Exception as lost:  # only an error of the database's comes out of it
                    return done, lost
            done += len(part)
        return done, None

    async def _record_alone(self, result: AttemptResult, exc: BaseException) -> None:
        """One result that failed on its own: recorded plain, else plain without its DSN and
        suppression entry, else dropped (its lease runs out and it is tried again). Raises only an
        error that is not about the result (`is_about_the_values`)."""
        plain = plain_result(result, plain_error(exc))
        failure = exc
        for step, notices_too, instead in (
            ("isolated", True, "recording it plain"),
            ("without_notices", False, "recording it plain without its DSN and suppression entry"),
        ):
            log.error(
                "could not record the outcome of recipient %s (attempt %d, %s): %s; %s",
                result.recipient_id,
                result.attempt,
                result.outcome,
                plain_error(failure),
                instead,
                exc_info=failure,
            )
            RECORD_FAILURES.labels(step=step).inc()
            try:
                await self.record([plain], notices_too=notices_too)
                return
            except Exception as again:
                if not is_about_the_values(again):
                    raise
                failure = again
        log.error(
            "could not record the outcome of recipient %s at all (%s): dropped; its lease runs "
            "out and it is tried again (a possible duplicate)",
            result.recipient_id,
            plain_error(failure),
            exc_info=failure,
        )
        RECORD_FAILURES.labels(step="dropped").inc()

    async def record(self, results: Sequence[AttemptResult], *, notices_too: bool = True) -> None:
        """Record one batch of outcomes, in ONE database transaction.

        Everything that must commit together with an outcome belongs in this transaction (bounce
        messages for bounced and expired recipients, suppression entries); `notices_too=False`
        leaves those out (`_record_alone`).
        """
        offer = await self.webhooks.offer() if self.webhooks is not None else NO_OFFER
        events: list[ClaimedEvent] = []
        waiting: set[uuid.UUID] = set()
        try:
            done = await apply_outcomes(
                self.pool,
                results,
                hostname=self.settings.server.hostname,
                suppress_for=self.settings.bounces.suppress_for,
                offer=offer,
                notices_too=notices_too,
            )
            events, waiting = done.events, done.waiting_events
        finally:
            # Whatever happened: the sender's room is its own again. Events of a commit whose
            # answer was lost are claimed for it all the same; they are due again after the lease.
            if self.webhooks is not None:
                self.webhooks.take(offer, events, waiting)
        # Committed: nothing after this may fail the record, which would record it again.
        try:
            applied = done.applied
            # Only outcomes that took effect: a fenced-out (stale) result is logged, not counted.
            counts = collections.Counter(
                str(r.outcome) for r in results if r.recipient_id in applied
            )
            for outcome, count in counts.items():
                DELIVERIES.labels(outcome=outcome).inc(count)
            self._log_results(results)
        except Exception:
            log.exception("%d delivery result(s) recorded, but not logged", len(results))

    def _log_results(self, results: Sequence[AttemptResult]) -> None:
        """Delivery-log records, written after the commit (the same events are in the database)."""
        by_delivery: dict[int, tuple[Delivery, list[AttemptResult]]] = {}
        for result in results:
            delivery = self.claims.delivery_of(result.recipient_id)
            if delivery is None:
                continue
            entry = by_delivery.setdefault(id(delivery), (delivery, []))
            entry[1].append(result)
        for delivery, delivered in by_delivery.values():
            self.delivery_log.attempts(delivery, delivered)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            # A recorder that has stopped is no longer stalled; what it left is the engine's.
            self._progress_at = None
            self._watch(0.0)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._watch(loop.time())
            if not self._pending:
                if self._finishing:
                    return
                self._pending_event.clear()
                await self._pending_event.wait()
                self._since = loop.time()
                continue
            # The results of transactions that finish within record_wait of the oldest pending
            # one join its batch. So do those that came while the previous batch was being
            # recorded: recorded at once, they made batches of a few results each (a statement
            # and a commit apiece), when mail is handed to the engine one group commit at a time.
            wait = self._since + self.settings.delivery.record_wait - loop.time()
            if wait > 0 and not self._finishing and len(self._pending) < RECORD_BATCH:
                await asyncio.sleep(wait)
                continue
            batch = self._pending[:RECORD_BATCH]
            started = loop.time()
            done, error = await self.record_isolating(batch)
            for result in batch[:done]:
                self.claims.forget(result)
            del self._pending[:done]
            RECORDER_PENDING.set(len(self._pending))
            if done:
                self._progress_at = loop.time()
            if error is not None:
                # The database is away: the rest is kept (dropping it would send the mail again
                # after the lease) and tried again.
                RECORD_FAILURES.labels(step="database").inc()
                log.warning(
                    "could not record %d delivery result(s): %s; retrying",
                    len(batch) - done,
                    plain_text(str(error) or type(error).__name__, 200),
                )
                if self._finishing:
                    return
                self._watch(loop.time())
                await asyncio.sleep(RETRY_AFTER)
                continue
            # What is still pending came while this batch was being recorded.
            self._since = started

    def _watch(self, now: float) -> None:
        """Say whether results have waited longer than `stall_after` with none recorded."""
        stalled = (
            bool(self._pending)
            and self._progress_at is not None
            and now - self._progress_at > self.stall_after
        )
        if stalled != self._stalled:
            self._stalled = stalled
            RECORDERS_STALLED.set(1 if stalled else 0)
            if stalled:
                log.error(
                    "the recorder has recorded nothing for over %g s while %d result(s) wait",
                    self.stall_after,
                    len(self._pending),
                )
            else:
                log.info("the recorder records again")

    @property
    def stalled(self) -> bool:
        return self._stalled

    @property
    def pending(self) -> tuple[AttemptResult, ...]:
        """The results waiting to be recorded."""
        return tuple(self._pending)
