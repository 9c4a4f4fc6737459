"""Whose Authentication-Results field is it: the authserv-id read as RFC 8601 2.2 has it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pigeon_mta.intake.authserv import authserv_id, claims_authserv_id
from pigeon_mta.intake.fixups import Trace, apply_fixups

OURS = [
    "mta.test; dkim=pass",
    "MTA.Test; auth=pass smtp.auth=ceo",
    "(c) mta.test; dkim=pass",
    "mta.test(c); dkim=pass",
    "(a (nested \\) comment) b)mta.test (x) 1; none",
    ' \t(c)\t"mta.test" ; spf=pass',
    '"mta\\.test"; spf=pass',
    "mta.test",  # no results: malformed, but a lax reader takes it as ours
    "mta.test; totally-unknown-method=pass",  # authres cannot parse this one
]
THEIRS = [
    "mta.test.evil; spf=pass",
    "other.example; dkim=pass",
    "(mta.test) other.example; dkim=pass",
    '"mta.test.evil"; spf=pass',
    "evil.mta.test; spf=pass",
    "(unclosed mta.test; dkim=pass",
    '"unclosed mta.test; dkim=pass',
    "; dkim=pass",
    "",
]


@pytest.mark.parametrize("value", OURS)
def test_fields_bearing_our_authserv_id(value: str) -> None:
    assert claims_authserv_id(value, "mta.test")


@pytest.mark.parametrize("value", THEIRS)
def test_fields_bearing_another_or_no_authserv_id(value: str) -> None:
    assert not claims_authserv_id(value, "mta.test")


def test_deeply_nested_comments_are_read_without_recursion() -> None:
    depth = 20_000
    assert authserv_id("(" * depth + ")" * depth + " mta.test; none") == "mta.test"
    assert authserv_id("(" * depth + " mta.test; none") is None
    assert authserv_id("(\\" * depth) is None


@pytest.mark.parametrize("value", OURS)
def test_forged_results_with_comments_are_removed_from_the_message(value: str) -> None:
    raw = f"Authentication-Results: {value}\r\nAuthentication-Results: other.example; spf=pass\r\n"
    fixed = apply_fixups(
        (raw + "Subject: s\r\n\r\nbody\r\n").encode(),
        Trace(
            hostname="mta.test",
            queue_id="QID",
            client_ip="192.0.2.7",
            helo="client.example",
            esmtp=True,
            smtputf8=False,
            tls_version=None,
            tls_cipher=None,
            auth_user="alice",
            recipients=("bob@example.net",),
            received_at=datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC),
        ),
        new_message_id="n@m",
    )
    assert f"Authentication-Results: {value}\r\n".encode() not in fixed.data
    assert fixed.data.count(b"Authentication-Results:") == 2  # ours and other.example's
    assert b"Authentication-Results: other.example; spf=pass\r\n" in fixed.data
