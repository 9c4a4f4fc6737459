"""`judge`: each recipient's result at a stage -> outcome, category, rule and next try (a table)."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from pigeon_mta.backoff import backoff_window
from pigeon_mta.config import DeliverySettings, Duration
from pigeon_mta.model import (
    EXPIRED_CATEGORY,
    AttemptResult,
    ClaimedRecipient,
    Delivery,
    Outcome,
    Reply,
)
from pigeon_mta.outbound.attempt import Peer, RecipientResult
from pigeon_mta.outbound.classify import Stage
from pigeon_mta.outbound.outcome import LOCAL_FAILURE_LIMIT, judge
from pigeon_mta.signer import KeysUnavailable

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
SETTINGS = DeliverySettings(
    retry_initial=Duration(300), retry_max=Duration(3600), max_age=Duration(86400)
)
PEER = Peer("mx.example.net", "192.0.2.25", 25)
D, X, B, E = Outcome.DELIVERED, Outcome.DEFERRED, Outcome.BOUNCED, Outcome.EXPIRED


def judged(
    result: Reply | BaseException,
    stage: Stage,
    *,
    attempts: int = 1,
    queued_ago: float = 60,
    last_reply: Reply | None = None,
    max_age: float | None = None,
) -> tuple[Outcome, str | None, str | None, datetime | None]:
    out = judged_result(
        result,
        stage,
        attempts=attempts,
        queued_ago=queued_ago,
        last_reply=last_reply,
        max_age=max_age,
    )
    return out.outcome, out.category, out.rule, out.next_attempt_at


def judged_result(
    result: Reply | BaseException,
    stage: Stage,
    *,
    attempts: int = 1,
    queued_ago: float = 60,
    last_reply: Reply | None = None,
    max_age: float | None = None,
) -> AttemptResult:
    """The one recipient's AttemptResult that `judge` makes of `result` at `stage`."""
    recipient = ClaimedRecipient(
        id=uuid.uuid4(),
        address="bob@example.net",
        attempts=attempts,
        queued_at=NOW - timedelta(seconds=queued_ago),
        last_reply=last_reply,
    )
    delivery = Delivery(
        queue_id=uuid.uuid4(),
        org_id=uuid.uuid4(),
        sender="alice@example.com",
        domain="example.net",
        header_message_id=None,
        received_at=NOW,
        body=b"",
        recipients=(recipient,),
    )
    (out,) = judge(
        delivery,
        [RecipientResult(recipient, stage, result)],
        peer=PEER,
        duration=0.5,
        started_at=NOW,
        now=NOW,
        settings=SETTINGS,
        rng=random.Random(7),
        max_age=max_age,
    )
    assert (out.recipient_id, out.attempt, out.mx_host) == (recipient.id, attempts, PEER.host)
    return out


@pytest.mark.parametrize(
    ("result", "stage", "outcome", "category", "rule"),
    [
        (Reply(250, "2.0.0", "queued"), "dot", D, None, "accepted"),
        (Reply(550, "5.1.1", "user unknown"), "rcpt", B, "invalid-recipient", "permanent"),
        (Reply(451, "4.7.1", "greylisted"), "rcpt", X, "greylisted", "temporary"),
        (Reply(552, None, "too many recipients"), "rcpt", X, "rate-limited", "552-at-rcpt-is-452"),
        (Reply(554, None, "go away"), "connect", X, "other", "connect-refused"),
        (Reply(0, "5.1.10", "publishes a null MX"), "route", B, "bad-domain", "local-permanent"),
        (ConnectionResetError("reset"), "dot", X, "connection", "lost-after-data"),
    ],
)
def test_each_result_gets_its_outcome_category_and_rules(
    result: Reply | BaseException, stage: Stage, outcome: Outcome, category: str | None, rule: str
) -> None:
    got, got_category, got_rule, next_at = judged(result, stage)
    assert (got, got_category) == (outcome, category)
    assert got_rule is not None and got_rule.split("; ")[0] == rule
    # The category's rule follows the outcome's: both are kept on the attempt.
    assert (got_rule == rule) == (outcome == D)
    if outcome == X:
        low, high = backoff_window(1, 300, 3600)
        assert next_at is not None and low <= (next_at - NOW).total_seconds() <= high
    else:
        assert next_at is None


def test_a_deferral_whose_next_try_would_come_after_max_age_expires_now() -> None:
    outcome, category, rule, next_at = judged(
        Reply(451, "4.2.0", "try later"), "rcpt", attempts=5, queued_ago=86400 - 60
    )
    assert (outcome, next_at) == (E, None)
    assert rule is not None and rule.startswith("temporary; max-age; ")
    # The category every expiry has, the sweeper's too (store/upkeep.py); the reply's own
    # category's rule stays in the rule.
    assert category == EXPIRED_CATEGORY == "expired"


def test_the_same_local_failure_on_every_attempt_bounces_but_a_database_blip_never_does() -> None:
    error = RuntimeError("cannot process this message")
    previous = Reply(
        0,
        "4.3.0",
        f"RuntimeError: cannot process this message (the same local failure on "
        f"{LOCAL_FAILURE_LIMIT - 1} attempts in a row)",
    )
    outcome, category, rule, _ = judged(error, "connect", last_reply=previous)
    assert (outcome, category, rule) == (
        B,
        "other",
        "local-failure-repeated; local-failure-repeated",
    )
    blip = KeysUnavailable("cannot process this message")
    assert judged(blip, "connect", last_reply=previous)[0] == X


def test_a_lane_max_age_replaces_delivery_max_age() -> None:
    """Queued two hours ago: within delivery.max_age (1 day), past a lane's 1 hour (the engine
    passes Settings.max_age_of the delivery's lane)."""
    later = Reply(451, "4.7.1", "greylisted")
    assert judged(later, "rcpt", queued_ago=7200)[0] == X
    outcome, _category, rule, next_at = judged(later, "rcpt", queued_ago=7200, max_age=3600)
    assert (outcome, next_at) == (E, None) and rule is not None and "max-age" in rule
    assert judged(later, "rcpt", queued_ago=60, max_age=3600)[0] == X


@pytest.mark.parametrize(
    "reply",
    [
        Reply(550, "5.7.1", "Daily sending quota exceeded"),
        Reply(554, None, "Message rejected: sending rate limit exceeded"),
        Reply(550, "5.7.28", "Our system has detected an unusual rate of unsolicited mail"),
    ],
)
def test_a_permanent_reply_that_says_rate_limit_defers(reply: Reply) -> None:
    """Too much, too fast is the sender's state, not the recipient's: retried, not bounced."""
    outcome, category, rule, next_at = judged(reply, "rcpt")
    assert outcome == X and category == "rate-limited"
    assert rule is not None and "permanent; rate-limit-is-temporary" in rule
    assert next_at is not None and next_at > NOW


def test_a_permanent_reply_about_the_recipient_still_bounces() -> None:
    outcome, _category, rule, _next = judged(Reply(550, "5.1.1", "user unknown"), "rcpt")
    assert outcome == B and rule is not None and "rate-limit" not in rule


def test_a_mailbox_code_keeps_a_rate_worded_reply_a_bounce() -> None:
    """'too many messages' from a full mailbox (5.2.2) is about the recipient."""
    outcome, _category, rule, _next = judged(
        Reply(552, "5.2.2", "Mailbox full: too many messages in the mailbox"), "dot"
    )
    assert outcome == B and rule is not None and "rate-limit-is-temporary" not in rule


def test_a_deferred_5xx_rate_limit_is_a_throttling_reply_for_the_budget() -> None:
    from pigeon_mta.outbound.classify import throttling_reply

    def results(reply: Reply) -> list[AttemptResult]:
        return [judged_result(reply, "rcpt")]

    quota = Reply(550, "5.7.1", "Daily sending quota exceeded")
    assert throttling_reply(results(quota)) == quota
    assert throttling_reply(results(Reply(550, "5.1.1", "user unknown"))) is None
    assert throttling_reply(results(Reply(552, None, "too many recipients"))) is None
