"""Each recipient's result judged, pure: an SMTP reply or error at a stage becomes an AttemptResult
with its outcome, its category and the rules that chose them, and the time of the next try (or
expiry once the next try would come after delivery.max_age). The recorder (outbound/recorder.py)
applies them in batches (outbound/apply.py).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from pigeon_mta.backoff import backoff_delay
from pigeon_mta.config import DeliverySettings
from pigeon_mta.model import (
    DEADLINE_CATEGORY,
    EXPIRED_CATEGORY,
    AttemptResult,
    ClaimedRecipient,
    Delivery,
    Outcome,
    Reply,
)
from pigeon_mta.outbound.attempt import Peer, RecipientResult
from pigeon_mta.outbound.categories import Category
from pigeon_mta.outbound.classify import (
    Verdict,
    classify,
    classify_reply,
    rate_limits_are_temporary,
    stated_retry_delay,
)
from pigeon_mta.plain import plain_text
from pigeon_mta.signer import KeysUnavailable

# Outcomes that end a recipient's delivery in failure and so are reported to the sender.
FAILED_OUTCOMES = frozenset({Outcome.BOUNCED, Outcome.EXPIRED})
SUPPRESSED_RULE = "suppression-list"
DEADLINE_RULE = "deadline"


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
        deadline = False
        if outcome == Outcome.DEFERRED:
            delay = backoff_delay(
                item.recipient.attempts, settings.retry_initial, settings.retry_max, rng
            )
            next_at = now + timedelta(seconds=delay)
            if next_at > item.recipient.queued_at + age_limit:
                # The next try would come after max_age: give up now, with this reply.
                outcome, rule, next_at = Outcome.EXPIRED, f"{rule}; max-age", None
            elif delivery.expires_at is not None and next_at >= delivery.expires_at:
                # ... or after the message's deadline.
                outcome, rule, next_at = Outcome.EXPIRED, f"{rule}; {DEADLINE_RULE}", None
                deadline = True
        category = None
        if outcome != Outcome.DELIVERED:
            bounce_class = classify_reply(verdict.reply)
            category, rule = str(bounce_class.category), f"{rule}; {bounce_class.rule}"
            if outcome == Outcome.EXPIRED:
                category = DEADLINE_CATEGORY if deadline else EXPIRED_CATEGORY
            if next_at is not None and bounce_class.category == Category.RATE_LIMITED:
                next_at = _after_stated_delay(next_at, verdict.reply, now)
        out.append(
            AttemptResult(
                recipient_id=item.recipient.id,
                queue_id=delivery.queue_id,
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
                    queue_id=delivery.queue_id,
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


def split_past_deadline(
    deliveries: Sequence[Delivery], *, now: datetime
) -> tuple[list[Delivery], list[AttemptResult]]:
    """Split claimed work into what may be attempted and the `expired` results of the
    deliveries whose message's deadline (the send intent's `expires_at`) has passed: no
    attempt starts after it."""
    keep: list[Delivery] = []
    results: list[AttemptResult] = []
    for delivery in deliveries:
        if delivery.expires_at is None or delivery.expires_at > now:
            keep.append(delivery)
            continue
        results.extend(_deadline_result(delivery, r, now) for r in delivery.recipients)
    return keep, results


def _deadline_result(delivery: Delivery, r: ClaimedRecipient, now: datetime) -> AttemptResult:
    assert delivery.expires_at is not None
    last = r.last_reply
    text = f"not attempted: the message's deadline {_utc(delivery.expires_at)} has passed" + (
        f"; last reply: {last.text}" if last is not None and last.text else ""
    )
    return AttemptResult(
        recipient_id=r.id,
        queue_id=delivery.queue_id,
        org_id=delivery.org_id,
        attempt=r.attempts,
        outcome=Outcome.EXPIRED,
        reply=Reply(last.code if last else 0, last.enhanced_code if last else None, text),
        started_at=now,
        category=DEADLINE_CATEGORY,
        rule=DEADLINE_RULE,
    )


def _utc(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


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
        queue_id=delivery.queue_id,
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
