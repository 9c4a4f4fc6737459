"""Pure classification: what an SMTP reply or a local error means for a recipient, and when to retry.

Errors are temporary unless proven permanent: only a 5xx reply from the recipient's server (or a
local finding that is certain, such as a null MX) bounces; everything unexpected is deferred, never
dropped.
"""

from __future__ import annotations

import random
import re
import ssl
from dataclasses import dataclass
from typing import Literal

from pigeon_mta.model import Outcome, Reply

# Where in the conversation a reply or error came from.
#   route:   DNS / routing, before any connection (local findings carry code 0)
#   connect: TCP connect, greeting, EHLO, STARTTLS (failures here are about the path, not the
#            recipient)
#   auth:    AUTH at a relayhost
#   mail, rcpt, data: the reply to MAIL FROM, RCPT TO, DATA
#   dot:     the reply to the final dot (after the whole message was sent)
Stage = Literal["route", "connect", "auth", "mail", "rcpt", "data", "dot"]

_ENHANCED = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})(?:\s+|$)")


@dataclass(frozen=True)
class Verdict:
    """The outcome for one recipient, the reply to record, and the rule that decided."""

    outcome: Outcome
    reply: Reply
    rule: str


def parse_reply(code: int, message: str) -> Reply:
    """An SMTP reply as a Reply; a leading enhanced status code (RFC 3463) is split off and kept."""
    match = _ENHANCED.match(message)
    if match:
        return Reply(code, f"{match[1]}.{match[2]}.{match[3]}", message[match.end() :])
    return Reply(code, None, message)


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


# ---------------------------------------------------------------- repeated local failures

# A local failure (an exception inside pigeon-mta, not a reply from a peer) that recurs word for
# word on this many attempts in a row is taken to be about the message, not the moment (a message
# the code cannot process): the recipient bounces with 5.3.0 instead of being retried, each time
# with a traceback in the log, until delivery.max_age. A failure that passes (the database away)
# reads differently from one try to the next, or is not "unknown-error" at all.
LOCAL_FAILURE_LIMIT = 3

_REPEATS = re.compile(r" \(the same local failure on (\d+) attempts in a row\)\Z")


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
