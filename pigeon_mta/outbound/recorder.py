"""The engine's record stage: results wait here and are recorded in batches, one transaction each.

Each batch goes through `apply_outcomes` (outbound/outcome.py); what took effect is counted, and
the delivery log gets its records after the commit (the same events are in the database). A batch
that cannot be recorded is kept and tried again: dropping it would send the mail again once its
leases ran out. The process's webhook sender offers each batch its free room, and gets the webhook
events written within it after the commit, already claimed for it (webhooks/sender.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Sequence, Set
from typing import Protocol

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.metrics import DELIVERIES
from pigeon_mta.model import AttemptResult, Delivery
from pigeon_mta.outbound.claims import Claims
from pigeon_mta.outbound.outcome import apply_outcomes
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.webhooks import NO_OFFER, ClaimedEvent, Offer

log = logging.getLogger(__name__)

# Results recorded in one statement at most; a busy engine records in batches of up to this.
RECORD_BATCH = 1000


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
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.claims = claims
        self.delivery_log = delivery_log
        self.webhooks = webhooks
        self._pending: list[AttemptResult] = []
        self._pending_event = asyncio.Event()
        self._finishing = False
        # When the oldest pending result came (on the event loop's clock), at the latest.
        self._since = 0.0

    def submit(self, results: Sequence[AttemptResult]) -> None:
        self.claims.judged(results)
        self._pending.extend(results)
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
            await self.record(final)
            for result in final:
                self.claims.forget(result)
        self._pending.clear()

    async def record(self, results: Sequence[AttemptResult]) -> None:
        """Record one batch of outcomes, in ONE database transaction.

        Everything that must commit together with an outcome belongs in this transaction (bounce
        messages for bounced and expired recipients, suppression entries).
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
            )
            events, waiting = done.events, done.waiting_events
        finally:
            # Whatever happened: the sender's room is its own again. Events of a commit whose
            # answer was lost are claimed for it all the same; they are due again after the lease.
            if self.webhooks is not None:
                self.webhooks.take(offer, events, waiting)
        applied = done.applied
        # Only outcomes that took effect: a fenced-out (stale) result is logged, not counted.
        counts = collections.Counter(str(r.outcome) for r in results if r.recipient_id in applied)
        for outcome, count in counts.items():
            DELIVERIES.labels(outcome=outcome).inc(count)
        self._log_results(results)

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
        loop = asyncio.get_running_loop()
        while True:
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
            try:
                await self.record(batch)
            except DB_ERRORS as exc:
                log.warning("could not record %d delivery result(s): %s; retrying", len(batch), exc)
                if self._finishing:
                    return
                await asyncio.sleep(1.0)
                continue
            except Exception:
                # Keep the results (dropping them would send the mail again after the lease);
                # the error is in the log every time it happens.
                log.exception("could not record %d delivery result(s); retrying", len(batch))
                if self._finishing:
                    return
                await asyncio.sleep(1.0)
                continue
            del self._pending[: len(batch)]
            # What is still pending came while this batch was being recorded.
            self._since = started
            for result in batch:
                self.claims.forget(result)
