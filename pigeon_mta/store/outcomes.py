"""The record of delivery outcomes: one statement moves the recipients (only where their claim still
holds), appends the attempt rows, and writes the webhook events of the applied outcomes.

The claim (store/leases.py) increments `attempts`, which serves as a fencing token: an outcome is
applied only while the row is still `delivering` with the attempt number of that claim, so a
worker whose lease ran out cannot overwrite the work of the claim that replaced it; its outcome
is still logged, as not applied.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from pigeon_mta.ids import new_ids
from pigeon_mta.model import AttemptResult, Outcome, Status, storable_text
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.webhooks import (
    NO_OFFER,
    ClaimedEvent,
    Offer,
    OfferParameters,
    claimed_event,
    event_payload,
    outbox_insert,
)

_WEBHOOK_PAYLOAD = event_payload(
    type_="v.outcome",
    queue_id="v.message_id",
    recipient_id="v.recipient_id",
    recipient="u.address",
    code="v.code",
    enhanced_code="v.enhanced_code",
    response="v.response",
    category="v.category",
    attempt="v.attempt",
    next_attempt_at="v.next_attempt_at",
)

_OUTBOX = outbox_insert(
    message="v.message_id",
    rows="v JOIN u ON u.id = v.recipient_id AND u.attempts = v.attempt",
    type_="v.outcome",
    org_id="v.org_id",
    payload=_WEBHOOK_PAYLOAD,
    where="EXISTS (SELECT FROM webhook WHERE org_id = ANY ($4::uuid[]))",
    offer=OfferParameters(webhooks="$22", rooms="$23", other="$24", lease="$25"),
)

# One statement: the recipient rows move (only where the claim still holds, see module doc), the
# attempt rows are appended, each saying whether its outcome was applied, and the webhook events of
# the applied outcomes go to the outbox (pigeon_mta/webhooks/), committed with them: those within
# the room the caller's sender offers are written claimed for it and come back whole. It runs on
# connections that plan it once (store/connect.py `record_pool`), so nothing in it may let that
# plan depend on the table's size: the status it fences on is a parameter ($21, 'delivering'),
# not a constant, for with a constant PostgreSQL may read the rows through the partial indexes of
# live rows while the table is small (recipient_live, recipient_leased), and keep that plan once
# they are many. As it is, the one index the plan can use is the primary key.
_RECORD = f"""
WITH v AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::int[], $6::text[],
                         $7::timestamptz[], $8::float8[], $9::timestamptz[], $10::text[],
                         $11::text[], $12::int[], $13::text[], $14::text[], $15::int[],
                         $16::text[], $17::text[], $18::text[], $19::text[], $20::text[])
        AS v (attempt_id, recipient_id, message_id, org_id, attempt, outcome,
              started_at, duration, next_attempt_at, mx_host,
              ip, port, tls_version, tls_cipher, code,
              enhanced_code, response, category, rule, dkim)
), u AS (
    UPDATE recipient r
    SET status = CASE v.outcome WHEN 'deferred' THEN 'queued' ELSE v.outcome END,
        next_attempt_at = COALESCE(v.next_attempt_at, r.next_attempt_at),
        lease_until = NULL,
        lease_owner = NULL,
        last_code = v.code,
        last_enhanced_code = v.enhanced_code,
        last_response = v.response,
        postponed = NULL,
        -- A deferred recipient waits for its next attempt in the retry queue, out of the claim's
        -- way (store/leases.py wakes it when it is due); every other one leaves its queue.
        site = CASE WHEN v.outcome = 'deferred' AND v.next_attempt_at > now()
                    THEN 'later' END,
        updated_at = now()
    FROM v
    WHERE r.id = v.recipient_id AND r.status = $21 AND r.attempts = v.attempt
    RETURNING r.id, r.attempts, r.address
), w AS (
    -- The events within the room the caller's webhook sender offers (store/webhooks.py `Offer`)
    -- are written claimed by it and returned; the others wait for a sender's claim. Applied
    -- outcomes only. When no org of the batch has a webhook, the EXISTS (one probe of
    -- webhook_org per distinct org) is false and the join is never run: nothing is read or
    -- written.
    {_OUTBOX}
), a AS (
    INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, duration_ms,
                         mx_host, ip, port, tls_version, tls_cipher, code, enhanced_code, response,
                         outcome, category, rule, next_attempt_at, applied, dkim)
    SELECT v.attempt_id, v.recipient_id, v.message_id, v.org_id, v.attempt, v.started_at,
           v.duration * 1000, v.mx_host, v.ip, v.port, v.tls_version, v.tls_cipher, v.code,
           v.enhanced_code, v.response, v.outcome, v.category, v.rule, v.next_attempt_at,
           u.id IS NOT NULL, v.dkim
    -- By claim, not by row: a stale outcome of a recipient that a newer claim in the same batch
    -- moved is still not applied.
    FROM v LEFT JOIN u ON u.id = v.recipient_id AND u.attempts = v.attempt
    RETURNING recipient_id, attempt, applied
)
-- Only the exceptions travel back (normally none): one row per outcome was 100 rows to decode.
SELECT recipient_id, attempt, NULL::uuid AS id, NULL::uuid AS webhook_id, NULL::text AS url,
       NULL::text AS secret, NULL::text AS body, NULL::int AS attempts,
       NULL::timestamptz AS created_at
FROM a WHERE NOT applied
UNION ALL
-- Then the new events (id: the event's): those claimed for the caller's sender in full, as a
-- claim returns them, the others by webhook alone.
SELECT NULL, NULL, w.id, w.webhook_id, h.url, h.secret, w.payload::text, w.attempts, w.created_at
FROM w JOIN webhook h ON h.id = w.webhook_id WHERE w.attempts = 1
UNION ALL
SELECT NULL, NULL, w.id, w.webhook_id, NULL, NULL, NULL, NULL, NULL FROM w WHERE w.attempts = 0
"""


@dataclass(frozen=True)
class Recorded:
    """What one record statement did."""

    applied: set[uuid.UUID]  # recipient ids whose state moved
    # The new webhook events written claimed for the caller's sender (within its offer's room).
    events: list[ClaimedEvent] = field(default_factory=list)
    # The webhooks with new events waiting in the outbox for a claim (beyond the offer's room).
    waiting: set[uuid.UUID] = field(default_factory=set)


async def record_outcomes(
    db: Executor, results: Sequence[AttemptResult], offer: Offer = NO_OFFER
) -> Recorded:
    """Record a batch of outcomes in one statement, with their webhook events.

    A result whose claim no longer holds is still written to the attempt log (applied = false), so
    a delivery made after a lease ran out shows up as a possible duplicate instead of vanishing.
    """
    if not results:
        return Recorded(applied=set())
    for result in results:
        if result.outcome == Outcome.DEFERRED and result.next_attempt_at is None:
            raise ValueError("a deferred outcome needs next_attempt_at")
    not_applied: set[tuple[uuid.UUID, int]] = set()
    events: list[ClaimedEvent] = []
    waiting: set[uuid.UUID] = set()
    for row in await db.fetch(_RECORD, *_record_arguments(results, offer)):
        if row["id"] is None:
            not_applied.add((row["recipient_id"], row["attempt"]))
        elif row["body"] is None:
            waiting.add(row["webhook_id"])
        else:
            events.append(claimed_event(row))
    applied = {r.recipient_id for r in results if (r.recipient_id, r.attempt) not in not_applied}
    return Recorded(applied, events, waiting)


def _record_arguments(results: Sequence[AttemptResult], offer: Offer = NO_OFFER) -> list[object]:
    """The parameters of _RECORD: one array per column, one element per result; the status of a
    claimed row; then the webhook sender's offer."""
    return [
        new_ids(len(results)),
        [r.recipient_id for r in results],
        [r.queue_id for r in results],
        [r.org_id for r in results],
        [r.attempt for r in results],
        [str(r.outcome) for r in results],
        [r.started_at for r in results],
        [r.duration for r in results],
        [r.next_attempt_at for r in results],
        [storable_text(r.mx_host) for r in results],
        [storable_text(r.ip) for r in results],
        [r.port for r in results],
        [storable_text(r.tls_version) for r in results],
        [storable_text(r.tls_cipher) for r in results],
        [r.reply.code or None for r in results],
        [storable_text(r.reply.enhanced_code) for r in results],
        [storable_text(r.reply.text) for r in results],
        [storable_text(r.category) for r in results],
        [storable_text(r.rule) for r in results],
        [storable_text(r.dkim) for r in results],
        str(Status.DELIVERING),
        list(offer.rooms),
        list(offer.rooms.values()),
        offer.other,
        float(offer.lease),
    ]
