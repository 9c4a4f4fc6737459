"""The send intent's fields: read from X-Pigeon-* header fields and from the API's JSON alike,
times as RFC 3339 or seconds from now, every bad value and unknown field refused by name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon_mta.intake.intent import NONE, Intent, IntentError, from_fields, from_json

NOW = datetime(2026, 12, 4, 10, 0, 0, tzinfo=UTC)


def test_header_fields_give_the_whole_intent_and_others_pass() -> None:
    intent = from_fields(
        [
            ("X-Pigeon-Expires", "300"),
            ("x-pigeon-send-at", "2026-12-04T11:00:00+01:00"),
            ("X-Pigeon-Order-Key", "account-42"),
            ("X-Pigeon-Meta-Event-Id", "evt_1"),
            ("X-Pigeon-Meta-tag", "  welcome \r\n mail "),
            ("X-Pigeon-Lane", "bulk"),
            ("X-Pigeon-Submitted", "by mta.test"),
        ],
        NOW,
    )
    assert intent == Intent(
        expires_at=NOW + timedelta(seconds=300),
        send_at=NOW,  # 11:00 at +01:00
        order_key="account-42",
        metadata={"event-id": "evt_1", "tag": "welcome mail"},
    )
    assert from_fields([], NOW) == NONE and NONE.empty


@pytest.mark.parametrize(
    ("fields", "name", "problem"),
    [
        ([("X-Pigeon-Colour", "red")], "X-Pigeon-Colour", "is not a field pigeon-mta knows"),
        ([("X-Pigeon-Expires", "tomorrow")], "X-Pigeon-Expires", "must be an RFC 3339"),
        ([("X-Pigeon-Expires", "2026-12-04T10:00:00")], "X-Pigeon-Expires", "with its offset"),
        ([("X-Pigeon-Expires", "\u0661\u0662")], "X-Pigeon-Expires", "must be an RFC 3339"),
        ([("X-Pigeon-Expires", "2025-01-01T00:00:00Z")], "X-Pigeon-Expires", "is past already"),
        ([("X-Pigeon-Send-At", "99999999999")], "X-Pigeon-Send-At", "must be 0 to 365 days"),
        ([("X-Pigeon-Send-At", "2027-12-05T00:00:00Z")], "X-Pigeon-Send-At", "more than 365"),
        (
            [("X-Pigeon-Expires", "60"), ("X-Pigeon-Send-At", "120")],
            "X-Pigeon-Send-At",
            "is not before X-Pigeon-Expires",
        ),
        ([("X-Pigeon-Order-Key", "x" * 201)], "X-Pigeon-Order-Key", "1 to 200 printable"),
        ([("X-Pigeon-Send-At", "0001-01-01T00:00:00+01:00")], "X-Pigeon-Send-At", "not a time"),
        ([("X-Pigeon-Send-At", "2026-02-30T00:00:00Z")], "X-Pigeon-Send-At", "not a time"),
        ([("X-Pigeon-Expires", "5"), ("X-Pigeon-Expires", "6")], "X-Pigeon-Expires", "twice"),
        ([("X-Pigeon-Meta-a", "1"), ("x-pigeon-meta-A", "2")], "x-pigeon-meta-A", "twice"),
        ([("X-Pigeon-Meta-a.b", "1")], "metadata.a.b", "lower-case letters"),
        ([("X-Pigeon-Meta-a", "\x07")], "metadata.a", "printable"),
        ([(f"X-Pigeon-Meta-m{i}", "v") for i in range(11)], "metadata", "more than 10"),
    ],
)
def test_bad_header_fields_are_refused_by_name(
    fields: list[tuple[str, str]], name: str, problem: str
) -> None:
    with pytest.raises(IntentError) as info:
        from_fields(fields, NOW)
    assert info.value.name == name and problem in info.value.problem


def test_json_fields_and_their_refusals() -> None:
    intent = from_json(
        {"expires_at": 60, "send_at": "2026-12-04T10:00:30Z", "metadata": {"order": "7"}}, NOW
    )
    assert intent.expires_at == NOW + timedelta(seconds=60)
    assert intent.send_at == NOW + timedelta(seconds=30)
    assert intent.metadata == {"order": "7"} and intent.order_key is None
    for request, name in [
        ({"expires_at": True}, "expires_at"),
        ({"send_at": [1]}, "send_at"),
        ({"order_key": 5}, "order_key"),
        ({"metadata": {"n": 1}}, "metadata"),
        ({"metadata": ["a"]}, "metadata"),
        ({"metadata": {"Upper": "x"}}, "metadata.Upper"),
    ]:
        with pytest.raises(IntentError) as info:
            from_json(request, NOW)
        assert info.value.name == name, request


def test_the_doors_own_intent_wins_and_metadata_merges() -> None:
    door = Intent(order_key="a", metadata={"x": "door"})
    message = Intent(order_key="b", send_at=NOW, metadata={"x": "header", "y": "header"})
    assert door.over(message) == Intent(
        send_at=NOW, order_key="a", metadata={"x": "door", "y": "header"}
    )


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(
        ["X-Pigeon-Expires", "X-Pigeon-Send-At", "X-Pigeon-Order-Key", "X-Pigeon-Meta-a"]
    ),
    value=st.one_of(
        st.text(max_size=40),
        st.from_regex(
            r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}([+-][0-9]{2}:[0-9]{2}|Z)"
        ),
    ),
)
def test_any_value_is_taken_or_refused_by_name_never_raised(name: str, value: str) -> None:
    """A hostile value is an IntentError naming its field, never another exception."""
    try:
        from_fields([(name, value)], NOW)
    except IntentError as exc:
        assert exc.name in (name, "metadata.a", "X-Pigeon-Expires", "X-Pigeon-Send-At")
