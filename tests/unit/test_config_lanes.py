"""[lanes]: the built-in lanes, what a file changes or adds, and the lane names and values refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon_mta.config import Duration, LaneSettings
from pigeon_mta.config_loader import ConfigError, load_settings


def load(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return load_settings(path, env={})


def test_transactional_and_bulk_are_built_in(tmp_path: Path) -> None:
    lanes = load(tmp_path, "").lanes
    assert lanes == {
        "transactional": LaneSettings(weight=10.0),
        "bulk": LaneSettings(weight=1.0),
    }


def test_a_file_changes_only_the_keys_it_sets_of_a_built_in_lane_and_adds_lanes(
    tmp_path: Path,
) -> None:
    lanes = load(
        tmp_path,
        '[lanes.transactional]\nrate = 500\n[lanes.bulk]\nmax_age = "2d"\n'
        "[lanes.alerts]\nweight = 50\n",
    ).lanes
    assert lanes["transactional"] == LaneSettings(weight=10.0, rate=500.0)
    assert lanes["bulk"] == LaneSettings(weight=1.0, max_age=Duration(2 * 86400))
    assert lanes["alerts"] == LaneSettings(weight=50.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[lanes.Bulk2]\n", "bad lane name 'lanes.Bulk2'"),
        ('[lanes."a b"]\n', "bad lane name 'lanes.a b'"),
        ("[lanes.bulk]\nweight = 0\n", "'lanes.bulk.weight' must be more than zero"),
        ("[lanes.x]\nrate = -1\n", "'lanes.x.rate' must not be negative"),
        ("[lanes.x]\nspeed = 1\n", "unknown key 'lanes.x.speed'"),
        (
            '[[listener]]\nname = "r"\naddress = "127.0.0.1:2525"\nlane = "nope"\n',
            "listener 'r': lane 'nope' is not a lane (lanes: bulk, transactional)",
        ),
    ],
)
def test_bad_lanes_are_refused_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, text)
    assert message in str(refused.value)


def test_a_listener_may_name_a_declared_lane(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        '[lanes.newsletters]\nweight = 2\n[[listener]]\nname = "r"\n'
        'address = "127.0.0.1:2525"\nlane = "newsletters"\n',
    )
    assert settings.listener[0].lane == "newsletters"


@pytest.mark.parametrize("policy", ["any", "lower", "off"])
def test_lanes_header_is_a_policy_not_a_lane(tmp_path: Path, policy: str) -> None:
    settings = load(tmp_path, f'[lanes]\nheader = "{policy}"\n[lanes.alerts]\nweight = 50\n')
    assert settings.lane_header == policy
    assert set(settings.lanes) == {"transactional", "bulk", "alerts"}


def test_lanes_header_defaults_to_lower_and_refuses_other_words(tmp_path: Path) -> None:
    assert load(tmp_path, "").lane_header == "lower"
    with pytest.raises(
        ConfigError, match=r"'lanes.header': 'higher' is not one of any, lower, off"
    ):
        load(tmp_path, '[lanes]\nheader = "higher"\n')
