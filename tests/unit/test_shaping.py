"""Reply rules (`[[shaping.rule]]`): which rule a reply meets, what it does to the attempt, the
shipped rules against the providers' documented replies, and the config's refusals."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pigeon_mta.config_loader import ConfigError, load_settings
from pigeon_mta.config_shaping import ShapingSettings
from pigeon_mta.model import AttemptResult, Outcome, Reply
from pigeon_mta.outbound import shaping

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
ORG_A, ORG_B = uuid.uuid4(), uuid.uuid4()


def settings(tmp_path: Path, text: str) -> ShapingSettings:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return load_settings(path, env={}).shaping


def result(reply: Reply, outcome: Outcome, *, org: uuid.UUID = ORG_A, host: str = "mx.test"):
    return AttemptResult(
        recipient_id=uuid.uuid4(),
        queue_id=uuid.uuid4(),
        org_id=org,
        attempt=1,
        outcome=outcome,
        reply=reply,
        started_at=NOW,
        next_attempt_at=NOW + timedelta(seconds=300) if outcome == Outcome.DEFERRED else None,
        mx_host=host,
        rule="temporary",
    )


RULES = """
[shaping]
defaults = false
[[shaping.rule]]
name = "blocked"
match = '5\\.7\\.1 .*block list'
action = "suspend"
scope = "all"
duration = "10m"
[[shaping.rule]]
name = "gone-for-good"
match = 'account (has been )?closed'
action = "bounce"
[[shaping.rule]]
name = "slow-partner"
match = 'slow down'
site = "*.partner.example, other.example"
action = "rate"
value = 2
duration = "30m"
[[shaping.rule]]
name = "any-slow"
match = 'slow'
action = "sessions"
value = 1
"""


def test_the_first_rule_whose_reply_and_host_match_decides(tmp_path: Path) -> None:
    rules = shaping.compile_rules(settings(tmp_path, RULES))
    slow = Reply(421, "4.7.0", "Please SLOW   down")
    # The host names the site: the partner's rule; another host: the next rule that matches.
    assert shaping.matching(rules, slow, "mx1.partner.example", "site:x").name == "slow-partner"
    assert shaping.matching(rules, slow, "other.example", "site:x").name == "slow-partner"
    assert shaping.matching(rules, slow, "mx.elsewhere.test", "site:x").name == "any-slow"
    # The site's key as `queue` shows it counts as a name too.
    assert shaping.matching(rules, slow, None, "a.partner.example").name == "slow-partner"
    # Code, enhanced code and text in one line, case-insensitive.
    blocked = Reply(550, "5.7.1", "Part of your network is on our block list (S3150)")
    assert shaping.matching(rules, blocked, "mx.test", "site:x").name == "blocked"
    assert shaping.matching(rules, Reply(250, "2.0.0", "ok"), "mx.test", "site:x") is None
    # Only the first 1,024 characters are read, as classification reads them.
    late = Reply(550, "5.1.1", "x" * 2000 + " account closed")
    assert shaping.matching(rules, late, "mx.test", "site:x") is None


def test_rules_change_the_attempt_and_ask_the_cluster_once_per_rule_and_org(
    tmp_path: Path,
) -> None:
    rules = shaping.compile_rules(settings(tmp_path, RULES))
    blocked = Reply(550, "5.7.1", "Part of your network is on our block list (S3150)")
    closed = Reply(450, "4.2.1", "Account has been closed")
    ok = Reply(250, "2.0.0", "ok")
    results = [
        result(blocked, Outcome.BOUNCED),
        result(blocked, Outcome.BOUNCED),
        result(blocked, Outcome.BOUNCED, org=ORG_B),
        result(closed, Outcome.DEFERRED),
        result(ok, Outcome.DELIVERED),
    ]
    out, actions = shaping.apply(results, rules, "route:127.0.0.2:25", NOW)
    # A suspension keeps the mail: a 5xx about our network defers, until it ends at least.
    for r in out[:3]:
        assert r.outcome == Outcome.DEFERRED and r.next_attempt_at == NOW + timedelta(minutes=10)
        assert r.rule == "temporary; shaping blocked: suspend all for 10m"
    assert out[3].outcome == Outcome.BOUNCED and out[3].next_attempt_at is None
    assert out[3].rule == "temporary; shaping gone-for-good: bounce"
    assert out[4] == results[4]
    assert sorted((a.rule.name, a.org_id == ORG_A) for a in actions) == [
        ("blocked", False),
        ("blocked", True),
    ]
    assert actions[0].reason.startswith("rule blocked (suspend all for 10m): 550 5.7.1 Part of")


def test_a_limit_rule_defers_a_permanent_reply_for_a_minute_under_the_limit(
    tmp_path: Path,
) -> None:
    rules = shaping.compile_rules(settings(tmp_path, RULES))
    reply = Reply(554, "5.7.0", "slow down, you send too much")
    [out], [action] = shaping.apply(
        [result(reply, Outcome.BOUNCED, host="mx2.partner.example")], rules, "site:x", NOW
    )
    assert out.outcome == Outcome.DEFERRED
    assert out.next_attempt_at == NOW + timedelta(seconds=shaping.RETRY_UNDER_LIMIT)
    assert (action.rule.action, action.rule.value, action.rule.duration) == ("rate", 2, 1800)
    assert action.rule.says() == "rate 2/s for 30m"


@pytest.mark.parametrize(
    ("host", "reply", "rule"),
    [
        (
            "alt1.aspmx.l.google.com",
            Reply(421, "4.7.28", "Our system has detected an unusual rate of unsolicited mail"),
            "gmail-unsolicited-rate",
        ),
        (
            "gmail-smtp-in.l.google.com",
            Reply(421, "4.7.0", "Our system has detected an unusual rate of traffic"),
            "gmail-unusual-rate",
        ),
        (
            "example-com.mail.protection.outlook.com",
            Reply(451, "4.7.650", "The mail server [192.0.2.1] has been temporarily rate limited"),
            "microsoft-ip-reputation",
        ),
        (
            "eur.olc.protection.outlook.com",
            Reply(550, "5.7.1", "Unfortunately, messages from [192.0.2.1] weren't sent (S3150)"),
            "microsoft-blocklist",
        ),
        (
            "mta7.am0.yahoodns.net",
            Reply(421, "4.7.0", "[TSS04] Messages from 192.0.2.1 temporarily deferred"),
            "yahoo-volume-complaints",
        ),
    ],
)
def test_the_shipped_rules_meet_their_providers_replies_and_no_one_elses(
    host: str, reply: Reply, rule: str
) -> None:
    rules = shaping.compile_rules(ShapingSettings())
    assert shaping.matching(rules, reply, host, "site:" + host).name == rule
    assert shaping.matching(rules, reply, "mx.example.org", "site:mx.example.org") is None


def test_the_shipped_rules_come_after_the_operators_and_can_be_left_out(tmp_path: Path) -> None:
    assert len(shaping.compile_rules(ShapingSettings())) == 5
    own = settings(tmp_path, RULES.replace("defaults = false", "defaults = true"))
    assert [r.name for r in shaping.compile_rules(own)][:5] == [
        "blocked",
        "gone-for-good",
        "slow-partner",
        "any-slow",
        "gmail-unsolicited-rate",
    ]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ('name = "x"\nmatch = "(("\naction = "bounce"', "is not a regular expression"),
        ('name = "x"\nmatch = "(a+)+$"\naction = "bounce"', "repeats a part that itself repeats"),
        ('name = "x"\nmatch = "y"\naction = "rate"', "needs a 'value' above zero"),
        ('name = "x"\nmatch = "y"\naction = "sessions"\nvalue = 1.5', "must be a whole number"),
        ('name = "x"\nmatch = "y"\naction = "pause"', "is not one of"),
        ('name = "x"\nmatch = "y"\naction = "suspend"\nscope = "tenant"', "is not one of"),
        ('name = "x"\nmatch = "y"\naction = "suspend"\nduration = "0s"', "more than zero"),
        ('name = " "\nmatch = "y"\naction = "bounce"', "needs a name"),
        ('match = "y"\naction = "bounce"', "missing key 'shaping.rule[0].name'"),
    ],
)
def test_a_bad_rule_is_refused_with_a_sentence(tmp_path: Path, entry: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        settings(tmp_path, f"[[shaping.rule]]\n{entry}\n")
    twice = '[[shaping.rule]]\nname = "x"\nmatch = "y"\naction = "bounce"\n'
    with pytest.raises(ConfigError, match="is taken by an earlier rule"):
        settings(tmp_path, twice + twice)


@pytest.mark.parametrize(
    ("host", "reply"),
    [
        # The recipient's address, echoed, names a shipped rule's code.
        (
            "eur.olc.protection.outlook.com",
            Reply(550, "5.1.10", "RESOLVER.ADR.RecipientNotFound; S3150@example.com not found"),
        ),
        (
            "eur.olc.protection.outlook.com",
            Reply(550, "5.7.1", "Delivery to <blocked-(S3150)@example.com> refused by policy"),
        ),
        # An IP address that holds an enhanced code.
        (
            "alt1.aspmx.l.google.com",
            Reply(421, "4.7.0", "Try again later, closing connection [203.4.7.28]"),
        ),
        (
            "example-com.mail.protection.outlook.com",
            Reply(451, "4.4.0", "Primary target IP 10.4.7.650 responded with 421"),
        ),
        (
            "alt1.aspmx.l.google.com",
            Reply(421, "4.7.0", "Try again later; we saw 203.4.7.28."),
        ),
        # The code in the text, not in the reply's code fields.
        (
            "mta7.am0.yahoodns.net",
            Reply(554, "5.0.0", "Your message quoted '421 4.7.0 [TSS04]' back at us"),
        ),
    ],
)
def test_the_shipped_rules_do_not_take_what_a_reply_echoes(host: str, reply: Reply) -> None:
    rules = shaping.compile_rules(ShapingSettings())
    assert shaping.matching(rules, reply, host, "site:" + host) is None


def test_a_reply_about_the_mailbox_is_never_taken_for_one_about_us(tmp_path: Path) -> None:
    """An operator's suspend rule whose pattern a 5.1.1 (no such user) or a 4.2.2 (mailbox
    full) also meets leaves those as they are; a bounce rule still applies to them."""
    rules = shaping.compile_rules(settings(tmp_path, RULES))
    unknown = Reply(550, "5.1.1", "No such user; 5.7.1 on our block list")
    full = Reply(452, "4.2.2", "Mailbox full: account closed soon")
    results = [result(unknown, Outcome.BOUNCED), result(full, Outcome.DEFERRED)]
    # One that a suspend rule meets first goes on to the bounce rule after it.
    closed = Reply(550, "5.1.1", "5.7.1 on our block list; account closed")
    results.append(result(closed, Outcome.BOUNCED))
    out, actions = shaping.apply(results, rules, "site:x", NOW)
    assert out[0] == results[0] and actions == []
    assert out[1].outcome == Outcome.BOUNCED and "gone-for-good" in (out[1].rule or "")
    assert "gone-for-good" in (out[2].rule or "")


def test_a_recipient_a_rule_would_retry_after_its_max_age_expires_now(tmp_path: Path) -> None:
    rules = shaping.compile_rules(settings(tmp_path, RULES))
    blocked = Reply(550, "5.7.1", "Part of your network is on our block list (S3150)")
    old, young = result(blocked, Outcome.BOUNCED), result(blocked, Outcome.BOUNCED)
    expires = {
        old.recipient_id: NOW + timedelta(minutes=5),
        young.recipient_id: NOW + timedelta(days=5),
    }
    out, actions = shaping.apply([old, young], rules, "site:x", NOW, expires)
    assert out[0].outcome == Outcome.EXPIRED and out[0].next_attempt_at is None
    assert out[0].category == "expired"  # as the sweeper says it (model.EXPIRED_CATEGORY)
    assert out[0].rule == "temporary; shaping blocked: suspend all for 10m; max-age"
    assert out[1].outcome == Outcome.DEFERRED
    assert len(actions) == 1  # the suspension is asked for all the same


def test_reading_a_hostile_reply_comes_out_bounded() -> None:
    """4 KB of one character, of "a@", of digits and dots, of "<": what the rules read comes out
    bounded, and an address at a sentence's end is replaced. (How long it takes is measured
    apart: 0.2-0.3 ms for each 4 KB here, against 8-14 ms before the patterns were anchored to a
    token's start.)"""
    for text in ("a" * 4096, "a@" * 2048, "1." * 2048, "<" * 4096):
        for _ in range(300):
            read = shaping.reply_text(Reply(550, "5.7.1", text))
        assert len(read) <= 1024
    assert shaping.reply_text(Reply(550, "5.1.1", "x" * 100 + " bob@example.com.")).endswith(
        "ADDRESS"
    )
