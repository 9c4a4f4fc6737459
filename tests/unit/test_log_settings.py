"""The `[log]` section: defaults, accepted values, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon_mta.config_loader import ConfigError, load_settings


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return load_settings(path, env={})


def test_defaults_log_info_as_text_and_delivery_records_to_stdout() -> None:
    log = load_settings(None, env={}).log
    assert (log.level, log.format, log.delivery_log) == ("info", "text", "-")


def test_a_log_section_is_read(tmp_path: Path) -> None:
    settings = load(
        tmp_path, '[log]\nlevel = "debug"\nformat = "json"\ndelivery_log = "/var/log/d.log"\n'
    )
    assert settings.log.level == "debug"  # type: ignore[attr-defined]
    assert settings.log.format == "json"  # type: ignore[attr-defined]
    assert settings.log.delivery_log == "/var/log/d.log"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[log]\nlevel = "verbose"\n', "log.level"),
        ('[log]\nformat = "xml"\n', "log.format"),
        ("[log]\ndelivery_log = 1\n", "log.delivery_log"),
        ('[log]\nfile = "x"\n', "log.file"),
    ],
)
def test_a_bad_log_setting_names_its_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(tmp_path, text)
