"""The limits against loops and junk: defaults, and a negative value named in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon_mta.config_loader import ConfigError, load_settings


def test_defaults_are_postfix_s() -> None:
    limits = load_settings(None, env={}).limits
    assert (limits.max_hops, limits.max_junk_commands) == (50, 100)


@pytest.mark.parametrize("key", ["max_hops", "max_junk_commands"])
def test_a_negative_limit_is_refused(tmp_path: Path, key: str) -> None:
    path = tmp_path / "pigeon.toml"
    path.write_text(f"[limits]\n{key} = -1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert f"'limits.{key}'" in str(info.value) and "not negative" in str(info.value)
