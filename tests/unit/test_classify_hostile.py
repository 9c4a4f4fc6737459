"""The classification table against hostile replies: codes read as ASCII digits, a bounded prefix
read, and no rule whose cost can grow faster than the text it reads.

Time is not asserted here (bench/classify_bench.py measures the table on 64 KB replies); what is
asserted is the shape that keeps it linear: every pattern the table and the stated-delay reader
use has only bounded repetition, so each position of the text costs at most a constant.
"""

from __future__ import annotations

import re

import pytest

from pigeon_mta.model import Reply
from pigeon_mta.outbound import classify
from pigeon_mta.outbound.categories import RULES, Category
from pigeon_mta.outbound.classify import (
    CLASSIFY_PREFIX,
    classify_reply,
    parse_reply,
    split_enhanced_code,
    stated_retry_delay,
)

# A repetition with no upper bound: *, + or {n,} (after a character class or escape is removed).
_UNBOUNDED = re.compile(r"(?<!\\)(?:\*|\+|\{[0-9]*,\})")


def _unbounded_repeats(pattern: str) -> list[str]:
    bare = re.sub(r"\\.", "e", pattern)  # escapes: one character each
    bare = re.sub(r"\[\^?\]?[^\]]*\]", "c", bare)  # character classes: one character each
    return _UNBOUNDED.findall(bare)


def _patterns() -> list[tuple[str, re.Pattern[str]]]:
    found = [("_ENHANCED", classify._ENHANCED), ("_RETRY_DELAY", classify._RETRY_DELAY)]
    for rule in RULES:
        for part in ("text", "enhanced", "code"):
            pattern = getattr(rule, part)
            if pattern is not None:
                found.append((f"{rule.name}.{part}", pattern))
    return found


@pytest.mark.parametrize(("name", "pattern"), _patterns(), ids=lambda v: str(v)[:40])
def test_no_pattern_repeats_without_a_bound(name: str, pattern: re.Pattern[str]) -> None:
    assert _unbounded_repeats(pattern.pattern) == [], name


def test_the_unbounded_repeat_check_finds_them() -> None:
    assert _unbounded_repeats(r"exceeded .*(rate|sending)") == ["*"]
    assert _unbounded_repeats(r"a[0-9]+b") == ["+"]
    assert _unbounded_repeats(r"a{2,}") == ["{2,}"]
    assert _unbounded_repeats(r"a\+b[*+]c{1,3}") == []


@pytest.mark.parametrize(
    "text",
    [
        "5.\u0661.1 User unknown",  # ARABIC-INDIC DIGIT ONE
        "\u0665.1.1 User unknown",  # ARABIC-INDIC DIGIT FIVE as the class
        "5.1.\uff11 User unknown",  # FULLWIDTH DIGIT ONE
        "5.1.1\u00a0User unknown",  # a no-break space is not the space RFC 2034 puts there
    ],
)
def test_an_enhanced_code_is_ascii_digits_and_a_space(text: str) -> None:
    assert split_enhanced_code(text) == (None, text)
    reply = parse_reply(550, text)
    assert reply.enhanced_code is None and reply.text == text


def test_a_well_formed_code_is_split_off() -> None:
    assert split_enhanced_code("5.1.1 User unknown") == ("5.1.1", "User unknown")
    assert split_enhanced_code("4.7.28\tslow down") == ("4.7.28", "slow down")
    # aiosmtplib joins a multi-line reply's lines with "\n": a first line of the code alone
    assert split_enhanced_code("5.1.1\nuser unknown") == ("5.1.1", "user unknown")


def test_a_stated_delay_is_ascii_digits() -> None:
    assert stated_retry_delay("try again in 60 seconds") == 60
    assert stated_retry_delay("try again in \u0666\u0660 seconds") is None


def test_only_the_first_part_of_a_reply_is_read() -> None:
    """Evidence past CLASSIFY_PREFIX is not looked for; evidence before it is found, whatever
    follows."""
    noise = "x" * CLASSIFY_PREFIX
    assert classify_reply(Reply(550, None, f"{noise} user unknown")).rule == "code-permanent"
    found = classify_reply(Reply(550, None, f"user unknown {noise * 15}"))
    assert found.category == Category.INVALID_RECIPIENT


@pytest.mark.parametrize(
    ("text", "category"),
    [
        ("exceeded " * 3600, Category.OTHER),
        ("exceeded the sending quota " + "exceeded " * 3600, Category.RATE_LIMITED),
        ("user unknown\n" * 2000, Category.INVALID_RECIPIENT),
        ("\x00\x1b[31m" * 5000, Category.OTHER),
        ("\u0661" * 30000, Category.OTHER),
        ("try again in " * 3000, Category.OTHER),
    ],
    ids=["exceeded", "exceeded-quota", "unknown-lines", "controls", "digits", "try-again"],
)
def test_adversarial_replies_are_classified(text: str, category: Category) -> None:
    assert classify_reply(Reply(550, None, text)).category == category
    assert stated_retry_delay(text) is None
