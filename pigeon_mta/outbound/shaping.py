"""Reply rules (`[[shaping.rule]]`, config_shaping.py) applied to a transaction's results: pure.

`apply` finds, for each recipient's reply that did not deliver, the first rule that matches
it and the MX host that gave it, and changes the result as the rule says (a bounce, or a deferral
until a suspension ends; an expiry when that would come after the recipient's max age); the
attempt's rule names the shaping rule and its action, which `pigeon-mta log` shows. It returns
the actions for the cluster (a suspension, a lowered rate or sessions), one per rule and org,
which the courier hands to its budgets.

What a rule reads is the reply as the server wrote it, less what the server echoes of the
message: addresses, anything in angle brackets, IPv4 addresses (each becomes a placeholder), so
that a recipient named "S3150@example.com" or an IP 203.4.7.28 does not set off a rule. A reply
about the recipient's mailbox (enhanced status X.1.* or X.2.*) is never taken for a reply about
us: a suspend, rate or sessions rule passes it by (a bounce rule still applies).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from pigeon_mta.config_shaping import ShapingRuleSettings, ShapingSettings
from pigeon_mta.model import EXPIRED_CATEGORY, AttemptResult, Outcome, Reply
from pigeon_mta.outbound.classify import CLASSIFY_PREFIX

# A recipient deferred by a rate or sessions rule after a permanent reply is tried again this soon
# (under the lowered limit).
RETRY_UNDER_LIMIT = 60.0
# What a rule's reason quotes of the reply.
QUOTED_REPLY = 200
# What the server echoes of the message, each replaced before the rules read the reply. Each
# starts only where a token does (the look-behinds), so that a hostile run of 4,000 characters
# costs one pass, not one per character.
_ECHOES = (
    (re.compile(r"<[^<>]{0,300}>"), "<>"),
    (
        re.compile(r"(?<![^\s<>\[\]()])[^\s<>\[\]()@]{1,200}@[^\s<>\[\]()]{1,200}"),
        "ADDRESS",
    ),
    # Not inside a longer run of digits and dots ("10.4.7.650"), but at a sentence's end.
    (re.compile(r"(?<![0-9])(?<![0-9]\.)[0-9]{1,3}(?:\.[0-9]{1,3}){3}(?![0-9]|\.[0-9])"), "IP"),
)
# Enhanced status classes about the recipient's mailbox (RFC 3463: X.1 address, X.2 mailbox).
_ABOUT_THE_MAILBOX = re.compile(r"^[245]\.[12]\.")


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    sites: tuple[str, ...]  # shell-style patterns; empty: any
    action: str
    scope: str
    value: float
    duration: float

    def says(self) -> str:
        """The action as the attempt's rule and the log word it."""
        if self.action == "bounce":
            return "bounce"
        limit = f" {self.value:g}/s" if self.action == "rate" else f" {self.value:g}"
        what = f"suspend {self.scope}" if self.action == "suspend" else self.action + limit
        return f"{what} for {_duration(self.duration)}"


@dataclass(frozen=True)
class Action:
    """What the cluster is to do after a matched reply."""

    rule: Rule
    org_id: uuid.UUID
    reason: str  # as `queue` and `log` show it


def compile_rules(settings: ShapingSettings) -> tuple[Rule, ...]:
    return tuple(_compiled(r) for r in settings.rules())


def _compiled(rule: ShapingRuleSettings) -> Rule:
    sites = tuple(s.strip().lower() for s in rule.site.split(",") if s.strip())
    return Rule(
        rule.name,
        re.compile(rule.match, re.IGNORECASE),
        sites,
        rule.action,
        rule.scope,
        float(rule.value),
        float(rule.duration),
    )


def matching(
    rules: Sequence[Rule], reply: Reply, host: str | None, site: str, text: str | None = None
) -> Rule | None:
    """The first rule whose pattern matches the reply and whose sites name `host` (the MX host
    that replied) or the site's key; for a reply about the mailbox, the first bounce rule.
    `text`: the reply's `reply_text`, when the caller has it."""
    if not rules:
        return None
    text = reply_text(reply) if text is None else text
    about_the_mailbox = bool(_ABOUT_THE_MAILBOX.match(reply.enhanced_code or ""))
    names = [n for n in ((host or "").lower(), site.lower()) if n]
    for rule in rules:
        if about_the_mailbox and rule.action != "bounce":
            continue
        if rule.sites and not any(fnmatch.fnmatchcase(n, s) for s in rule.sites for n in names):
            continue
        if rule.pattern.search(text):
            return rule
    return None


def reply_text(reply: Reply) -> str:
    """What the rules read of a reply: "CODE ENHANCED TEXT" on one line, the first 1,024
    characters, with what the server echoed of the message replaced (see the module's doc)."""
    text = reply.text[: 4 * CLASSIFY_PREFIX]
    for echo, placeholder in _ECHOES:
        text = echo.sub(placeholder, text)
    text = " ".join(f"{reply.code:03d} {reply.enhanced_code or ''} {text}".split())
    return text[:CLASSIFY_PREFIX]


def apply(
    results: Sequence[AttemptResult],
    rules: Sequence[Rule],
    site: str,
    now: datetime,
    expires: Mapping[uuid.UUID, datetime] | None = None,
) -> tuple[list[AttemptResult], list[Action]]:
    """The results as the rules change them, and the actions to take (one per rule and org).
    `expires`: when each recipient reaches its max age (queued_at + max age); a recipient a
    rule would retry after that expires now."""
    if not rules:
        return list(results), []
    out: list[AttemptResult] = []
    actions: dict[tuple[str, uuid.UUID], Action] = {}
    texts: dict[Reply, str] = {}  # a transaction's recipients mostly share one reply
    for result in results:
        if result.outcome not in (Outcome.DEFERRED, Outcome.BOUNCED):
            out.append(result)
            continue
        text = texts.get(result.reply)
        if text is None:
            text = texts[result.reply] = reply_text(result.reply)
        rule = matching(rules, result.reply, result.mx_host, site, text)
        if rule is None:
            out.append(result)
            continue
        out.append(_changed(result, rule, now, (expires or {}).get(result.recipient_id)))
        if rule.action != "bounce":
            reason = f"rule {rule.name} ({rule.says()}): {str(result.reply)[:QUOTED_REPLY]}"
            actions.setdefault((rule.name, result.org_id), Action(rule, result.org_id, reason))
    return out, list(actions.values())


def _changed(
    result: AttemptResult, rule: Rule, now: datetime, expires: datetime | None
) -> AttemptResult:
    named = f"{result.rule or ''}; shaping {rule.name}: {rule.says()}".lstrip("; ")
    if rule.action == "bounce":
        return dataclasses.replace(
            result, outcome=Outcome.BOUNCED, next_attempt_at=None, rule=named
        )
    if rule.action == "suspend":
        # Not attempted before the suspension ends: its retry comes then at the earliest.
        after = now + timedelta(seconds=rule.duration)
        next_at = max(result.next_attempt_at or after, after)
    else:
        next_at = result.next_attempt_at or now + timedelta(seconds=RETRY_UNDER_LIMIT)
    if expires is not None and next_at > expires:
        # The retry would come after the recipient's max age: it expires now, with this reply.
        return dataclasses.replace(
            result,
            outcome=Outcome.EXPIRED,
            next_attempt_at=None,
            category=EXPIRED_CATEGORY,
            rule=named + "; max-age",
        )
    return dataclasses.replace(
        result, outcome=Outcome.DEFERRED, next_attempt_at=next_at, rule=named
    )


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
