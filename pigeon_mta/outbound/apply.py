"""A batch of judged results applied in one database transaction, with everything that must commit
with them: the recipients' states and attempt rows and the webhook events (store/outcomes.py), the
DSNs for bounced and expired recipients (dsn_queue.py) and the suppression entries for hard bounces.
The recorder (outbound/recorder.py) calls it and counts what took effect.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from pigeon_mta import dsn_queue
from pigeon_mta.model import AttemptResult, Outcome
from pigeon_mta.outbound.classify import suppresses
from pigeon_mta.outbound.outcome import FAILED_OUTCOMES
from pigeon_mta.store import outcomes as store_outcomes
from pigeon_mta.store import suppression as store_suppression
from pigeon_mta.store.executor import Executor, transaction
from pigeon_mta.store.suppression import BounceEntry
from pigeon_mta.store.webhooks import NO_OFFER, ClaimedEvent, Offer


@dataclass(frozen=True)
class Applied:
    """What one apply_outcomes call did."""

    applied: set[uuid.UUID]  # recipient ids whose state moved (store/outcomes.py)
    bounces: list[uuid.UUID] = field(default_factory=list)  # queue ids of the DSNs queued
    suppressed: int = 0  # suppression entries written for hard bounces
    # The webhook events written claimed for the offering sender, and the webhooks with new
    # events waiting for a claim (store/outcomes.py `Recorded`): committed, for the sender.
    events: list[ClaimedEvent] = field(default_factory=list)
    waiting_events: set[uuid.UUID] = field(default_factory=set)


async def apply_outcomes(
    db: Executor,
    results: Sequence[AttemptResult],
    *,
    hostname: str,
    suppress_for: float = 0,
    offer: Offer = NO_OFFER,
    notices_too: bool = True,
) -> Applied:
    """Record a batch of outcomes in ONE transaction: the recipients' state and attempt rows, the
    webhook events (those within `offer` claimed for its sender), the DSNs for failures and the
    suppression entries for hard bounces. `notices_too=False` leaves out the DSNs and the
    suppression entries: the last resort for a result whose DSN cannot be built."""
    if not results:
        return Applied(applied=set())
    if not notices_too or not any(r.outcome in FAILED_OUTCOMES for r in results):
        # Nothing to bounce or suppress: the record statement is the whole transaction (one round
        # trip instead of BEGIN, record, COMMIT; most batches under load are like this).
        recorded = await store_outcomes.record_outcomes(db, results, offer)
        return Applied(
            applied=recorded.applied, events=recorded.events, waiting_events=recorded.waiting
        )
    async with transaction(db) as conn:
        recorded = await store_outcomes.record_outcomes(conn, results, offer)
        applied = recorded.applied
        failed = messages_needing_bounces(results, applied)
        bounces = await dsn_queue.queue_bounces(
            conn, [rid for ids in failed.values() for rid in ids], hostname=hostname
        )
        suppressed = await store_suppression.suppress_bounced(
            conn, bounce_suppressions(results, applied), suppress_for=suppress_for
        )
    return Applied(
        applied=applied,
        bounces=bounces,
        suppressed=suppressed,
        events=recorded.events,
        waiting_events=recorded.waiting,
    )


def messages_needing_bounces(
    results: Sequence[AttemptResult], applied: set[uuid.UUID]
) -> dict[uuid.UUID, list[uuid.UUID]]:
    """Failed recipients of one recorded round, grouped per message: one DSN per key.

    Only results whose outcome was applied count: a stale claim's bounce is logged but reports
    nothing, since the claim that replaced it owns the recipient now.
    """
    grouped: dict[uuid.UUID, list[uuid.UUID]] = {}
    for result in results:
        if result.outcome in FAILED_OUTCOMES and result.recipient_id in applied:
            grouped.setdefault(result.queue_id, []).append(result.recipient_id)
    return grouped


def bounce_suppressions(
    results: Sequence[AttemptResult], applied: set[uuid.UUID]
) -> list[BounceEntry]:
    """The applied hard bounces whose category (an invalid recipient, a bad domain) puts their
    address on the org's suppression list; `judge` gives every bounce its category."""
    return [
        BounceEntry(r.recipient_id, r.attempt, f"{r.category}: {r.reply}")
        for r in results
        if r.outcome == Outcome.BOUNCED and r.recipient_id in applied and suppresses(r.category)
    ]
