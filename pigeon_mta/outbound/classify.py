"""What an SMTP reply or a local error means for a recipient and for its destination.

One reading of a reply answers each question:
- `classify`: is the outcome final? Errors are temporary unless proven permanent, so only a 5xx
  reply from the recipient's server (or a local finding that is certain, such as a null MX)
  bounces; everything unexpected is deferred, never dropped. `rate_limits_are_temporary` defers a
  5xx that is about our rate.
- `classify_reply`: why? The category (invalid recipient, spam block...) from the table of rules
  in outbound/categories.py, so that operators can count reasons and the suppression list can
  tell a mailbox that does not exist from a server that dislikes us today (`suppresses`).
- `throttling_reply` and `is_connection_failure`: what does a transaction say of the
  destination's capacity (the budgets and the adaptive limits act on it)?
- `stated_retry_delay`: when does a throttling server ask us to come back?
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pigeon_mta.model import AttemptResult, Outcome, Reply
from pigeon_mta.outbound.categories import (
    RULES,
    SUPPRESSING_CATEGORIES,
    Category,
    Classification,
)
from pigeon_mta.plain import ENHANCED_CODE

# Where in the conversation a reply or error came from.
#   route:   DNS / routing, before any connection (local findings carry code 0)
#   connect: TCP connect, greeting, EHLO, STARTTLS (failures here are about the path, not the
#            recipient)
#   auth:    AUTH at a relayhost
#   mail, rcpt, data: the reply to MAIL FROM, RCPT TO, DATA
#   dot:     the reply to the final dot (after the whole message was sent)
Stage = Literal["route", "connect", "auth", "mail", "rcpt", "data", "dot"]

# An enhanced status code at the start of a reply's text (RFC 3463 section 2; RFC 2034 section 4
# puts one space between it and the text). ASCII digits only (plain.py).
_ENHANCED = re.compile(ENHANCED_CODE.pattern + r"(?:[ \t\r\n]|$)", re.ASCII)

# How much of a reply's text is read to classify it. The words that tell a reason come first
# (the enhanced code, "user unknown", "rate limited"); a hostile server's 32 KB reply is not worth
# reading whole, and every rule of outbound/categories.py runs in time linear in what it reads.
CLASSIFY_PREFIX = 1024


@dataclass(frozen=True)
class Verdict:
    """The outcome for one recipient, the reply to record, and the rule that decided."""

    outcome: Outcome
    reply: Reply
    rule: str


def parse_reply(code: int, message: str) -> Reply:
    """An SMTP reply as a Reply; a leading enhanced status code (RFC 3463) is split off and kept."""
    enhanced, text = split_enhanced_code(message)
    return Reply(code, enhanced, text)


def split_enhanced_code(text: str) -> tuple[str | None, str]:
    """The enhanced status code that `text` starts with (None when it has none), and the rest."""
    match = _ENHANCED.match(text)
    if match:
        return f"{match[1]}.{match[2]}.{match[3]}", text[match.end() :].lstrip(" \t\r\n")
    return None, text


def classify(result: Reply | BaseException, stage: Stage) -> Verdict:
    """The one place where replies and errors become outcomes (README.md "Delivery", Outcomes)."""
    if isinstance(result, BaseException):
        return _classify_error(result, stage)
    reply = result
    code = reply.code
    if code == 0:
        # A local finding dressed as a reply: its enhanced code says whether it is certain.
        if reply.enhanced_code and reply.enhanced_code.startswith("5."):
            return Verdict(Outcome.BOUNCED, reply, "local-permanent")
        return Verdict(Outcome.DEFERRED, reply, "local-temporary")
    if stage == "connect":
        # A refused greeting, EHLO or STARTTLS says nothing about the recipient.
        return Verdict(Outcome.DEFERRED, reply, "connect-refused")
    if stage == "auth":
        # A relayhost refusing our credentials is ours to fix; bouncing the mail would lose it.
        return Verdict(Outcome.DEFERRED, reply, "auth-failed")
    if 200 <= code < 300:
        if stage == "dot":
            return Verdict(Outcome.DELIVERED, reply, "accepted")
        return Verdict(Outcome.DEFERRED, reply, "unexpected-reply")
    if code == 552 and stage == "rcpt":
        # RFC 5321 4.5.3.1.10: 552 to RCPT is "too many recipients" from old servers; treat it
        # as the temporary 452 it should have been.
        return Verdict(Outcome.DEFERRED, reply, "552-at-rcpt-is-452")
    if 400 <= code < 500:
        return Verdict(Outcome.DEFERRED, reply, "temporary")
    if 500 <= code < 600:
        return Verdict(Outcome.BOUNCED, reply, "permanent")
    return Verdict(Outcome.DEFERRED, reply, "unexpected-reply")


def _classify_error(exc: BaseException, stage: Stage) -> Verdict:
    text = str(exc).strip() or type(exc).__name__
    if stage == "dot" and isinstance(exc, ConnectionError | TimeoutError | OSError):
        # The whole message went out and no reply came back: the peer may have delivered it.
        return Verdict(
            Outcome.DEFERRED,
            Reply(
                0,
                "4.4.2",
                f"{text} after the message was sent; it may have been delivered "
                "(possible duplicate on retry)",
            ),
            "lost-after-data",
        )
    if isinstance(exc, ssl.SSLError | ssl.CertificateError):
        return Verdict(Outcome.DEFERRED, Reply(0, "4.7.5", f"TLS failed: {text}"), "tls-failed")
    if isinstance(exc, TimeoutError):
        return Verdict(Outcome.DEFERRED, Reply(0, "4.4.2", f"timed out: {text}"), "timeout")
    if isinstance(exc, ConnectionError | OSError):
        return Verdict(
            Outcome.DEFERRED, Reply(0, "4.4.1", f"connection failed: {text}"), "connection"
        )
    return Verdict(
        Outcome.DEFERRED, Reply(0, "4.3.0", f"{type(exc).__name__}: {text}"), "unknown-error"
    )


def classify_reply(reply: Reply) -> Classification:
    """The category of a reply (or of a local failure dressed as one) and the rule that chose it."""
    code = f"{reply.code:03d}" if 0 <= reply.code <= 999 else "000"
    head = reply.text[:CLASSIFY_PREFIX]
    enhanced = reply.enhanced_code or ""
    if not enhanced:
        # Some servers' enhanced codes reach us still inside the text.
        enhanced = split_enhanced_code(head.lstrip())[0] or ""
    text = " ".join(head.split()).lower()
    for candidate in RULES:
        if candidate.matches(code, enhanced, text):
            return Classification(candidate.category, candidate.name)
    return Classification(Category.OTHER, "unrecognised")


def suppresses(category: str | None) -> bool:
    """Whether a hard bounce of this category puts the address on the suppression list."""
    return category in SUPPRESSING_CATEGORIES


# ---------------------------------------------------------------- the destination's capacity

# The rule that a permanent reply about our rate was deferred by (`throttling_reply` reads it).
RATE_LIMIT_IS_TEMPORARY = "rate-limit-is-temporary"


def rate_limits_are_temporary(verdict: Verdict) -> Verdict:
    """A permanent reply from a server that says it is limiting our rate ("550 5.7.1 sending
    rate exceeded", a 5xx with Gmail's 4.7.28 words) defers: too much, too fast is the sender's
    state at that moment, never the recipient's, and bouncing it would lose mail that the same
    server takes later. The throttling it reports lowers the destination's budget as a 4xx does
    (`throttling_reply`). An enhanced code about the mailbox or the address (5.1.x, 5.2.x:
    "5.2.2 mailbox full, too many messages") says what the words do not: that stays a bounce."""
    if verdict.outcome != Outcome.BOUNCED or verdict.reply.code < 500:
        return verdict
    enhanced = verdict.reply.enhanced_code
    if enhanced is not None and enhanced[2:3] not in ("3", "4", "7"):
        return verdict
    if classify_reply(verdict.reply).category != Category.RATE_LIMITED:
        return verdict
    return Verdict(Outcome.DEFERRED, verdict.reply, f"{verdict.rule}; {RATE_LIMIT_IS_TEMPORARY}")


def throttling_reply(results: Sequence[AttemptResult]) -> Reply | None:
    """The first rate-limited reply among a transaction's judged results that defers (a 4xx, or
    a 5xx about our rate, `rate_limits_are_temporary`): the destination's server asking for
    less."""
    for result in results:
        if result.category != Category.RATE_LIMITED or result.outcome == Outcome.BOUNCED:
            continue  # a bounce (a reply rule's) asks nothing of the destination's rate
        if 400 <= result.reply.code < 500 or RATE_LIMIT_IS_TEMPORARY in (result.rule or ""):
            return result.reply
    return None


def is_connection_failure(result: Reply | BaseException) -> bool:
    """Whether a recipient's result is a connection that failed or broke without a reply (the
    destination may be overloaded), rather than anything its server said."""
    return isinstance(result, BaseException)


# ---------------------------------------------------------------- a stated retry delay

# "try again in 60 seconds", "retry after 5 minutes", "please retry in 2 min": the delay a
# throttling destination asks for, honoured as the earliest next try.
# (Read in text whose white space is single spaces.)
_RETRY_DELAY = re.compile(
    r"\b(?:try(?: again)?|retry|again) (?:in|after) ([0-9]{1,6}) ?"
    r"(seconds?|secs?|s|minutes?|mins?|m|hours?|hrs?|h)\b"
)
_DELAY_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
# A stated delay longer than this is taken as this (a typo or a hostile server must not park
# mail for days).
MAX_STATED_DELAY = 3600.0


def stated_retry_delay(text: str) -> float | None:
    """The retry delay a reply's text states, in seconds, or None when it states none."""
    match = _RETRY_DELAY.search(" ".join(text[:CLASSIFY_PREFIX].split()).lower())
    if match is None:
        return None
    return min(MAX_STATED_DELAY, int(match[1]) * _DELAY_UNITS[match[2][0]])
