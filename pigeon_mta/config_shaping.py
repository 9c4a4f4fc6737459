"""`[shaping]` and its `[[shaping.rule]]` entries: what to do when a destination's reply says
something an operator (or a mailbox provider's documentation) knows the meaning of.

A rule is a regular expression over the reply ("CODE ENHANCED-CODE TEXT", case-insensitive, the
first 1,024 characters with whitespace runs made one space, and what the server echoes of the
message, addresses, <...> and IPv4 addresses, replaced by ADDRESS, <> and IP), optionally the MX
hosts it applies to, and an action:

    suspend   the site's mail is not attempted for `duration`: of the org whose mail got the reply
              (scope "org", the default) or of every org (scope "all"); the recipient is retried
              when it ends, also after a 5xx (the reply was about us, not the mailbox)
    rate      the site's cluster-wide rate is at most `value` messages a second for `duration`,
              then recovers as after a throttling reply
    sessions  the same for its sessions at once
    bounce    the recipient bounces, whatever the code said

The first rule that matches decides: the operator's in the order written, then (unless
`defaults = false`) the shipped ones below for the big providers' documented replies. The
runtime side is outbound/shaping.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pigeon_mta.config_values import Duration

Action = Literal["suspend", "rate", "sessions", "bounce"]
MAX_PATTERN = 1000


@dataclass(frozen=True)
class ShapingRuleSettings:
    """One [[shaping.rule]] entry."""

    name: str
    # A regular expression over "CODE ENHANCED-CODE TEXT" (Python syntax, case-insensitive).
    match: str
    action: Action
    # Shell-style patterns of the MX host that replied, or of the site's key as `queue` shows
    # it ("" = any host).
    site: str = ""
    # suspend: "org" (the org whose mail got the reply) or "all" (every org's mail to the site).
    scope: Literal["org", "all"] = "org"
    # rate: messages a second; sessions: sessions at once.
    value: float = 0.0
    # How long a suspend, rate or sessions action lasts.
    duration: Duration = Duration(3600)


# Shipped rules, each for a reply its provider documents. Mail stays queued through each (a
# suspension defers even a 5xx): the replies are about the sending IP or the volume, not about
# the recipient.
DEFAULT_RULES: tuple[ShapingRuleSettings, ...] = (
    # Gmail: "421-4.7.28 Our system has detected an unusual rate of unsolicited mail originating
    # from your IP address ... temporarily rate limited": the org whose mail drew it waits.
    ShapingRuleSettings(
        "gmail-unsolicited-rate",
        r"^4[0-9][0-9] 4\.7\.28\b",
        "suspend",
        site="*.google.com",
        duration=Duration(3600),
    ),
    # Gmail: "421-4.7.0 ... unusual rate of traffic" / "try again later": fewer sessions.
    ShapingRuleSettings(
        "gmail-unusual-rate",
        r"^4[0-9][0-9] 4\.7\.0\b.{0,200}\bunusual rate\b",
        "sessions",
        site="*.google.com",
        value=2,
        duration=Duration(900),
    ),
    # Microsoft: "451 4.7.650 The mail server [IP] has been temporarily rate limited due to IP
    # reputation" (4.7.651, 4.7.652 alike): a slow rate for an hour.
    ShapingRuleSettings(
        "microsoft-ip-reputation",
        r"^4[0-9][0-9] 4\.7\.65[0-2]\b",
        "rate",
        site="*.outlook.com",
        value=1,
        duration=Duration(3600),
    ),
    # Microsoft: "550 5.7.1 ... part of their network is on our block list (S3150)": the IP is
    # blocked for every tenant until delisted (sender.office.com); nothing is bounced meanwhile.
    ShapingRuleSettings(
        "microsoft-blocklist",
        r"^5[0-9][0-9] 5\.7\.1\b.{0,500}\(S3150\)",
        "suspend",
        site="*.outlook.com",
        scope="all",
        duration=Duration(6 * 3600),
    ),
    # Yahoo: "421 4.7.0 [TSS04] Messages from IP temporarily deferred due to unexpected volume or
    # user complaints": the org whose mail drew it waits.
    ShapingRuleSettings(
        "yahoo-volume-complaints",
        r"^4[0-9][0-9] (4\.7\.0 )?\[TSS04\]",
        "suspend",
        site="*.yahoodns.net",
        duration=Duration(3600),
    ),
)


@dataclass(frozen=True)
class ShapingSettings:
    """[shaping]: the reply rules."""

    # The shipped rules (DEFAULT_RULES) after the operator's; false: the operator's alone.
    defaults: bool = True
    rule: tuple[ShapingRuleSettings, ...] = field(default_factory=tuple)

    def rules(self) -> tuple[ShapingRuleSettings, ...]:
        """Every rule in force, in the order they are tried."""
        return self.rule + (DEFAULT_RULES if self.defaults else ())


def nested_repeat(pattern: str) -> bool:
    """Whether a repetition holds another repetition: the shape that can backtrack for a time
    exponential in the text (a reply is the destination's, hostile or not)."""
    try:
        from re import _parser  # type: ignore[attr-defined]

        tree = _parser.parse(pattern, re.IGNORECASE)
    except Exception:  # another Python's internals: the pattern compiled, that must do
        return False
    repeats = {_parser.MAX_REPEAT, _parser.MIN_REPEAT, getattr(_parser, "POSSESSIVE_REPEAT", None)}

    def walk(items: object, inside: bool) -> bool:
        for op, arg in items:  # type: ignore[attr-defined]
            if op in repeats:
                _low, high, sub = arg
                repeating = high > 1
                if repeating and inside:
                    return True
                if walk(sub, inside or repeating):
                    return True
            elif op is _parser.SUBPATTERN:
                if walk(arg[-1], inside):
                    return True
            elif op is _parser.BRANCH:
                if any(walk(branch, inside) for branch in arg[1]):
                    return True
            elif op in (_parser.ASSERT, _parser.ASSERT_NOT):
                if walk(arg[1], inside):
                    return True
        return False

    return walk(tree, False)


def check_shaping(shaping: ShapingSettings) -> str | None:
    """What is wrong with the rules, in a sentence (None: nothing)."""
    names: set[str] = set()
    for i, rule in enumerate(shaping.rule):
        where = f"'shaping.rule[{i}]'"
        if not rule.name.strip():
            return f"{where} needs a name"
        if rule.name in names:
            return f"{where}: the name {rule.name!r} is taken by an earlier rule"
        names.add(rule.name)
        if not rule.match or len(rule.match) > MAX_PATTERN:
            return f"{where}: 'match' must be a regular expression of 1 to {MAX_PATTERN} chars"
        try:
            re.compile(rule.match, re.IGNORECASE)
        except re.error as exc:
            return f"{where}: 'match' is not a regular expression: {exc}"
        if nested_repeat(rule.match):
            # (a+)+ takes time exponential in a reply crafted against it.
            return (
                f"{where}: 'match' repeats a part that itself repeats ({rule.match!r}); "
                "write it without the nesting"
            )
        if rule.action in ("rate", "sessions") and rule.value <= 0:
            return f"{where}: a {rule.action} action needs a 'value' above zero"
        if rule.action == "sessions" and rule.value != int(rule.value):
            return f"{where}: 'value' of a sessions action must be a whole number"
        if rule.action != "bounce" and rule.duration <= 0:
            return f"{where}: 'duration' must be more than zero"
    return None
