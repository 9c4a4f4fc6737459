"""choose_lane: the operator's lane, and how far X-Pigeon-Lane may move a message from it."""

from __future__ import annotations

import pytest

from pigeon_mta.config import LaneHeader, LaneSettings
from pigeon_mta.intake.lanes import choose_lane
from pigeon_mta.intake.refusal import Reason

LANES = {
    "transactional": LaneSettings(weight=10),
    "bulk": LaneSettings(weight=1, rate=10),  # the operator slowed it
    "bulk-fast": LaneSettings(weight=1),  # as much weight, no rate
    "slow": LaneSettings(weight=1, rate=5),
}


@pytest.mark.parametrize(
    ("header", "user_lane", "field", "lane"),
    [
        ("lower", "bulk", "transactional", "bulk"),  # more weight
        ("lower", "bulk", "bulk-fast", "bulk"),  # the same weight without the rate
        ("lower", "bulk", "slow", "slow"),  # no more weight and slower
        ("lower", "transactional", "bulk", "bulk"),  # a newsletter filed as bulk
        ("lower", "bulk-fast", "bulk", "bulk"),
        ("any", "bulk", "transactional", "transactional"),
        ("off", "bulk", "transactional", "bulk"),
        ("off", None, "no-such-lane", "transactional"),  # not read, so not refused
    ],
)
def test_the_field_moves_a_message_as_lanes_header_allows(
    header: LaneHeader, user_lane: str | None, field: str, lane: str
) -> None:
    choice = choose_lane(
        [field], user="app", user_lane=user_lane, listener_lane="", lanes=LANES, header=header
    )
    assert choice.refusal is None and choice.lane == lane
    assert (choice.overruled is not None) == (header == "lower" and lane != field)


def test_an_unknown_lane_is_refused_while_the_field_is_read() -> None:
    choice = choose_lane(
        ["express"], user=None, user_lane=None, listener_lane="", lanes=LANES, header="lower"
    )
    assert choice.lane == "" and choice.refusal is not None
    assert choice.refusal.reason is Reason.UNKNOWN_LANE and choice.refusal.lanes == ("express",)
