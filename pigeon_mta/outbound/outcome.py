"""The outcome path: each recipient's result judged (`judge`), a batch applied at once (`apply_outcomes`).

`judge` is pure: an SMTP reply or error at a stage becomes an AttemptResult with its outcome, its
category and the rules that chose them, and the time of the next try (or expiry once the next try
would come after delivery.max_age). `apply_outcomes` records a batch of them in one database
transaction, together with everything that must commit with them: the DSNs for bounced and expired
recipients and the suppression entries for hard bounces. The engine counts what took effect.
"""

from __future__ import annotations

import dataclasses
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pigeon_mta import notices
from pigeon_mta.config import DeliverySettings
from pigeon_mta.model import AttemptResult, ClaimedRecipient, Delivery, Outcome, Reply
from pigeon_mta.outbound.attempt import Peer, RecipientResult
from pigeon_mta.outbound.classify import (
    Category,
    Verdict,
    classify,
    classify_reply,
    stated_retry_delay,
    suppresses,
)
from pigeon_mta.plain import plain_text
from pigeon_mta.signer import KeysUnavailable
from pigeon_mta.store import outcomes as store_outcomes
from pigeon_mta.store import suppression as store_suppression
from pigeon_mta.store.executor import Executor, transaction
from pigeon_mta.store.suppression import BounceEntry
from pigeon_mta.store.webhooks import NO_OFFER, ClaimedEvent, Offer

# Outcomes that end a recipient's delivery in failure and so are reported to the sender.
FAILED_OUTCOMES = frozenset({Outcome.BOUNCED, Outcome.EXPIRED})
SUPPRESSED_RULE = "suppression-list"


def judge(
    delivery: Delivery,
    results: Sequence[RecipientResult],
    *,
    peer: Peer,
    duration: float,
    started_at: datetime,
    now: datetime,
    settings: DeliverySettings,
    rng: random.Random,
    dkim: str | None = None,
    max_age: float | None = None,
) -> list[AttemptResult]:
    """Each recipient's result -> an AttemptResult: outcome, next try, or expiry. `dkim` says
    how the message that was sent was signed (None when it was not sent). `max_age`: the
    delivery's lane's (Settings.max_age_of), else settings.max_age."""
    age_limit = timedelta(seconds=settings.max_age if max_age is None else max_age)
    out: list[AttemptResult] = []
    for item in results:
        verdict = classify(item.result, item.stage)
        if not isinstance(item.result, KeysUnavailable):  # the database away: it passes
            verdict = give_up_repeated_failure(verdict, item.recipient.last_reply)
        verdict = rate_limits_are_temporary(verdict)
        outcome, rule, next_at = verdict.outcome, verdict.rule, None
        if outcome == Outcome.DEFERRED:
            delay = backoff_delay(
                item.recipient.attempts, settings.retry_initial, settings.retry_max, rng
            )
            next_at = now + timedelta(seconds=delay)
            if next_at > item.recipient.queued_at + age_limit:
                # The next try would come after max_age: give up now, with this reply.
                outcome, rule, next_at = Outcome.EXPIRED, f"{rule}; max-age", None
        category = None
        if outcome != Outcome.DELIVERED:
            bounce_class = classify_reply(verdict.reply)
            category, rule = str(bounce_class.category), f"{rule}; {bounce_class.rule}"
            if next_at is not None and bounce_class.category == Category.RATE_LIMITED:
                next_at = _after_stated_delay(next_at, verdict.reply, now)
        out.append(
            AttemptResult(
                recipient_id=item.recipient.id,
                message_id=delivery.message_id,
                org_id=delivery.org_id,
                attempt=item.recipient.attempts,
                outcome=outcome,
                reply=verdict.reply.storable(),
                started_at=started_at,
                duration=duration,
                next_attempt_at=next_at,
                mx_host=peer.host,
                ip=peer.ip,
                port=peer.port,
                tls_version=peer.tls_version,
                tls_cipher=peer.tls_cipher,
                category=category,
                rule=rule,
                dkim=dkim,
            )
        )
    return out


# The rule that a permanent reply about our rate was deferred by (courier.throttling_reply reads it).
RATE_LIMIT_IS_TEMPORARY = "rate-limit-is-temporary"


def rate_limits_are_temporary(verdict: Verdict) -> Verdict:
    """A permanent reply from a server that says it is limiting our rate ("550 5.7.1 sending
    rate exceeded", a 5xx with Gmail's 4.7.28 words) defers: too much, too fast is the sender's
    state at that moment, never the recipient's, and bouncing it would lose mail that the same
    server takes later. The throttling it reports lowers the destination's budget as a 4xx does
    (courier.throttling_reply). An enhanced code about the mailbox or the address (5.1.x, 5.2.x:
    "5.2.2 mailbox full, too many messages") says what the words do not: that stays a bounce."""
    if verdict.outcome != Outcome.BOUNCED or verdict.reply.code < 500:
        return verdict
    enhanced = verdict.reply.enhanced_code
    if enhanced is not None and enhanced[2:3] not in ("3", "4", "7"):
        return verdict
    if classify_reply(verdict.reply).category != Category.RATE_LIMITED:
        return verdict
    return Verdict(Outcome.DEFERRED, verdict.reply, f"{verdict.rule}; {RATE_LIMIT_IS_TEMPORARY}")


def _after_stated_delay(next_at: datetime, reply: Reply, now: datetime) -> datetime:
    """A throttling destination that says when to come back is taken at its word: the next try
    then, rather than after the usual backoff (it is the destination's state, not the
    recipient's, that failed)."""
    delay = stated_retry_delay(reply.text)
    return next_at if delay is None else now + timedelta(seconds=delay)


def split_suppressed(
    deliveries: Sequence[Delivery], *, now: datetime
) -> tuple[list[Delivery], list[AttemptResult]]:
    """Split claimed work into what may be attempted and the `suppressed` results to record; the
    claim has read each recipient's entry (ClaimedRecipient.suppressed). A delivery left with no
    recipient is dropped; the results go to the same record call as the attempted ones.
    """
    keep: list[Delivery] = []
    results: list[AttemptResult] = []
    for delivery in deliveries:
        remaining = tuple(r for r in delivery.recipients if r.suppressed is None)
        for r in delivery.recipients:
            if r.suppressed is None:
                continue
            text = f"not attempted: {r.address} is on the suppression list ({r.suppressed})"
            results.append(
                AttemptResult(
                    recipient_id=r.id,
                    message_id=delivery.message_id,
                    org_id=delivery.org_id,
                    attempt=r.attempts,
                    outcome=Outcome.SUPPRESSED,
                    reply=Reply(0, None, text),
                    started_at=now,
                    category=Category.SUPPRESSED,
                    rule=SUPPRESSED_RULE,
                )
            )
        if len(remaining) == len(delivery.recipients):
            keep.append(delivery)
        elif remaining:
            keep.append(dataclasses.replace(delivery, recipients=remaining))
    return keep, results


def interrupted_after_data(
    delivery: Delivery, recipient: ClaimedRecipient, now: datetime
) -> AttemptResult:
    """The outcome of a transaction that stop broke off after its final dot: deferred, due at
    once, and marked as a possible duplicate."""
    reply = Reply(
        0,
        "4.3.2",
        "shutdown broke off the transaction after the message was sent; it may have "
        "been delivered (possible duplicate on retry)",
    )
    return AttemptResult(
        recipient_id=recipient.id,
        message_id=delivery.message_id,
        org_id=delivery.org_id,
        attempt=recipient.attempts,
        outcome=Outcome.DEFERRED,
        reply=reply,
        started_at=now,
        next_attempt_at=now,
        rule="interrupted-after-data",
    )


# ---------------------------------------------------------------- repeated local failures

# A local failure (an exception inside pigeon-mta, not a reply from a peer) that recurs word for
# word on this many attempts in a row is taken to be about the message, not the moment (a message
# the code cannot process): the recipient bounces with 5.3.0 instead of being retried, each time
# with a traceback in the log, until delivery.max_age. A failure that passes (the database away)
# reads differently from one try to the next, or is not "unknown-error" at all.
LOCAL_FAILURE_LIMIT = 3

_REPEATS = re.compile(r" \(the same local failure on ([0-9]+) attempts in a row\)\Z")


def give_up_repeated_failure(
    verdict: Verdict, previous: Reply | None, limit: int = LOCAL_FAILURE_LIMIT
) -> Verdict:
    """`verdict` for a local failure, counted against the reply the last attempt recorded.

    The count travels in the reply text ("... (the same local failure on 2 attempts in a row)"),
    so that it needs no column and an operator reading the log sees it; "the same" is the same
    exception type and message as that text records."""
    if verdict.rule != "unknown-error":
        return verdict
    reply = verdict.reply.storable()
    count = 1
    if previous is not None and previous.code == 0 and previous.enhanced_code == "4.3.0":
        match = _REPEATS.search(previous.text)
        earlier = previous.text[: match.start()] if match else previous.text
        if earlier == reply.text:
            count = (int(match[1]) if match else 1) + 1
    if count >= limit:
        text = f"{reply.text} (the same local failure on {count} attempts in a row; given up)"
        return Verdict(Outcome.BOUNCED, Reply(0, "5.3.0", text), "local-failure-repeated")
    if count > 1:
        text = f"{reply.text} (the same local failure on {count} attempts in a row)"
        return Verdict(verdict.outcome, Reply(0, reply.enhanced_code, text), verdict.rule)
    return verdict


# ---------------------------------------------------------------- retry timing


def backoff_window(attempts: int, initial: float, maximum: float) -> tuple[float, float]:
    """The range the delay before the next try falls in, after `attempts` tries.

    Exponential: initial, 2x, 4x ... capped at maximum; jitter spreads the next tries of mail
    that failed together (a destination that was down) over a quarter of the step, so they do
    not all come back at the same moment.
    """
    exponent = max(0, min(attempts - 1, 60))
    base = min(maximum, initial * (2.0**exponent))
    return max(initial, base * 0.75) if attempts > 1 else initial, min(maximum, base * 1.25)


def backoff_delay(
    attempts: int, initial: float, maximum: float, rng: random.Random | None = None
) -> float:
    """A delay drawn from `backoff_window`."""
    low, high = backoff_window(attempts, initial, maximum)
    return (rng or random).uniform(low, high)


# ---------------------------------------------------------------- a result made plain


def plain_result(result: AttemptResult, why: str) -> AttemptResult:
    """`result` with nothing in it that came from outside but plain ASCII, for a result that
    could not be recorded as it was (outbound/recorder.py): the same recipient, claim, outcome and
    next try, the reply's text plain and bounded, its enhanced code only when well-formed, and
    `why` it is plain in the text and the rule."""
    return dataclasses.replace(
        result,
        reply=result.reply.plain(f"recorded plain: {why}"),
        mx_host=None if result.mx_host is None else plain_text(result.mx_host, 255),
        ip=None if result.ip is None else plain_text(result.ip, 64),
        tls_version=None if result.tls_version is None else plain_text(result.tls_version, 64),
        tls_cipher=None if result.tls_cipher is None else plain_text(result.tls_cipher, 128),
        category=result.category and plain_text(result.category, 64),
        rule=f"{plain_text(result.rule or '', 200)}; record-failed".lstrip("; "),
        dkim=result.dkim and plain_text(result.dkim, 500),
    )


# ---------------------------------------------------------------- applying a batch


@dataclass(frozen=True)
class Applied:
    """What one apply_outcomes call did."""

    applied: set[uuid.UUID]  # recipient ids whose state moved (see queue.record_attempts)
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
        bounces = await notices.queue_bounces(
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
            grouped.setdefault(result.message_id, []).append(result.recipient_id)
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
