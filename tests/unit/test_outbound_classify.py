"""Classification table: what each reply or error at each stage means for the recipient."""

from __future__ import annotations

import random
import ssl

import aiosmtplib
import pytest

from pigeon_mta.backoff import backoff_delay, backoff_window
from pigeon_mta.model import Outcome, Reply
from pigeon_mta.outbound.classify import Stage, classify, parse_reply
from pigeon_mta.outbound.outcome import give_up_repeated_failure

D, B, X = Outcome.DELIVERED, Outcome.BOUNCED, Outcome.DEFERRED


@pytest.mark.parametrize(
    ("code", "text", "stage", "outcome", "rule"),
    [
        (250, "2.0.0 OK queued", "dot", D, "accepted"),
        (251, "user not local; will forward", "dot", D, "accepted"),
        (250, "OK", "rcpt", X, "unexpected-reply"),  # never final on its own
        (451, "4.7.1 greylisted", "rcpt", X, "temporary"),
        (452, "4.5.3 too many recipients", "rcpt", X, "temporary"),
        (421, "4.3.2 shutting down", "mail", X, "temporary"),
        (450, "mailbox busy", "dot", X, "temporary"),
        (550, "5.1.1 no such user", "rcpt", B, "permanent"),
        (552, "5.2.2 mailbox full", "rcpt", X, "552-at-rcpt-is-452"),
        (552, "5.3.4 message too big", "dot", B, "permanent"),
        (554, "5.6.0 content rejected", "dot", B, "permanent"),
        (553, "5.1.8 bad sender", "mail", B, "permanent"),
        (554, "no SMTP service here", "connect", X, "connect-refused"),
        (421, "busy", "connect", X, "connect-refused"),
        (535, "5.7.8 bad credentials", "auth", X, "auth-failed"),
        (354, "go ahead", "dot", X, "unexpected-reply"),
        (600, "what", "dot", X, "unexpected-reply"),
        (199, "what", "rcpt", X, "unexpected-reply"),
    ],
)
def test_replies(code: int, text: str, stage: Stage, outcome: Outcome, rule: str) -> None:
    verdict = classify(parse_reply(code, text), stage)
    assert (verdict.outcome, verdict.rule) == (outcome, rule)
    assert verdict.reply.code == code


@pytest.mark.parametrize(
    ("reply", "outcome", "rule"),
    [
        (Reply(0, "5.1.10", "null MX"), B, "local-permanent"),
        (Reply(0, "5.1.2", "NXDOMAIN"), B, "local-permanent"),
        (Reply(0, "4.4.3", "SERVFAIL"), X, "local-temporary"),
        (Reply(0, None, "something odd"), X, "local-temporary"),
    ],
)
def test_local_findings_follow_their_enhanced_code(
    reply: Reply, outcome: Outcome, rule: str
) -> None:
    verdict = classify(reply, "route")
    assert (verdict.outcome, verdict.rule, verdict.reply) == (outcome, rule, reply)


@pytest.mark.parametrize(
    ("error", "stage", "rule", "enhanced"),
    [
        (ConnectionRefusedError("refused"), "connect", "connection", "4.4.1"),
        (aiosmtplib.SMTPServerDisconnected("gone"), "rcpt", "connection", "4.4.1"),
        (aiosmtplib.SMTPReadTimeoutError("slow"), "mail", "timeout", "4.4.2"),
        (TimeoutError(), "connect", "timeout", "4.4.2"),
        (ssl.SSLCertVerificationError("bad cert"), "connect", "tls-failed", "4.7.5"),
        (aiosmtplib.SMTPServerDisconnected("gone"), "dot", "lost-after-data", "4.4.2"),
        (aiosmtplib.SMTPReadTimeoutError("slow"), "dot", "lost-after-data", "4.4.2"),
        (ValueError("a bug"), "rcpt", "unknown-error", "4.3.0"),
        (RuntimeError("a bug"), "dot", "unknown-error", "4.3.0"),
    ],
)
def test_errors_are_deferred(error: BaseException, stage: Stage, rule: str, enhanced: str) -> None:
    verdict = classify(error, stage)
    assert (verdict.outcome, verdict.rule, verdict.reply.enhanced_code) == (X, rule, enhanced)
    assert verdict.reply.code == 0


def test_lost_after_data_says_it_may_be_a_duplicate() -> None:
    verdict = classify(aiosmtplib.SMTPServerDisconnected("Connection lost"), "dot")
    assert "possible duplicate" in verdict.reply.text


@pytest.mark.parametrize(
    ("code", "message", "enhanced", "text"),
    [
        (250, "2.0.0 Ok: queued as 123", "2.0.0", "Ok: queued as 123"),
        (550, "5.1.1 <bob@x>: user unknown", "5.1.1", "<bob@x>: user unknown"),
        (451, "Try again later", None, "Try again later"),
        (550, "5.1.10", "5.1.10", ""),
        (550, "5.1 not an enhanced code", None, "5.1 not an enhanced code"),
    ],
)
def test_parse_reply_keeps_enhanced_codes(
    code: int, message: str, enhanced: str | None, text: str
) -> None:
    assert parse_reply(code, message) == Reply(code, enhanced, text)


@pytest.mark.parametrize(
    ("attempts", "window"),
    [
        (1, (300, 375)),
        (2, (450, 750)),
        (3, (900, 1500)),
        (4, (1800, 3000)),
        (5, (2700, 3600)),
        (50, (2700, 3600)),
    ],
)
def test_backoff_grows_exponentially_between_initial_and_max(
    attempts: int, window: tuple[float, float]
) -> None:
    assert backoff_window(attempts, 300, 3600) == window
    rng = random.Random(attempts)
    for _ in range(100):
        assert window[0] <= backoff_delay(attempts, 300, 3600, rng) <= window[1]


def test_backoff_with_equal_initial_and_max_is_fixed() -> None:
    assert backoff_window(7, 60, 60) == (60, 60)


_BUG = ValueError("cannot process this message")
_SAME = "ValueError: cannot process this message"


@pytest.mark.parametrize(
    ("previous", "outcome", "enhanced", "text"),
    [
        (None, X, "4.3.0", _SAME),
        (
            Reply(0, "4.3.0", _SAME),
            X,
            "4.3.0",
            f"{_SAME} (the same local failure on 2 attempts in a row)",
        ),
        (
            Reply(0, "4.3.0", f"{_SAME} (the same local failure on 2 attempts in a row)"),
            B,
            "5.3.0",
            f"{_SAME} (the same local failure on 3 attempts in a row; given up)",
        ),
        # Another error, or the same text from a peer or of another class: the count starts again.
        (Reply(0, "4.3.0", "ValueError: something else"), X, "4.3.0", _SAME),
        (Reply(451, "4.3.0", _SAME), X, "4.3.0", _SAME),
        (Reply(0, "4.4.1", _SAME), X, "4.3.0", _SAME),
    ],
)
def test_a_local_failure_repeated_word_for_word_bounces_at_the_limit(
    previous: Reply | None, outcome: Outcome, enhanced: str, text: str
) -> None:
    verdict = give_up_repeated_failure(classify(_BUG, "connect"), previous)
    assert (verdict.outcome, verdict.reply.enhanced_code, verdict.reply.text) == (
        outcome,
        enhanced,
        text,
    )
    assert verdict.reply.code == 0


def test_only_local_failures_are_counted() -> None:
    """A peer's reply or a connection error that recurs is the peer's, and may pass."""
    for result, stage in (
        (Reply(451, "4.3.0", "busy"), "dot"),
        (ConnectionRefusedError(), "connect"),
    ):
        verdict = classify(result, stage)  # type: ignore[arg-type]
        assert give_up_repeated_failure(verdict, verdict.reply) == verdict
