"""config/pigeon.toml: it loads, and it documents every option the settings schema knows."""

from __future__ import annotations

import re
import tomllib
from typing import Any

from pigeon_mta.config_loader import load_settings, settings_schema_keys
from tests.conftest import REPO, run_pigeon

EXAMPLE = REPO / "config" / "pigeon.toml"


def flattened_keys(data: Any, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    if isinstance(data, list) and data and all(isinstance(item, dict) for item in data):
        for item in data:
            keys |= flattened_keys(item, prefix)
        return keys
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{prefix}{key}"
            keys.add(name)
            if isinstance(value, dict | list):
                keys |= flattened_keys(value, name + ".")
    return keys


def test_example_config_loads() -> None:
    settings = load_settings(EXAMPLE, env={})
    assert settings.source == str(EXAMPLE)


def test_check_config_passes_on_the_example() -> None:
    result = run_pigeon("check-config", str(EXAMPLE))
    assert result.returncode == 0, result.stderr


def commented_keys(text: str) -> set[str]:
    """Options shown as a commented-out line (`# key = value`) under their [table] (itself
    commented out where the table is one to copy, such as [[outbox]]): those whose default
    differs per machine, such as server.node_name, and must not be copied as a value."""
    keys: set[str] = set()
    table = ""
    for line in text.splitlines():
        if header := re.fullmatch(r"(?:#\s?)?\[+([\w.\"-]+)\]+\s*(#.*)?", line.strip()):
            table = header.group(1) + "."
        elif option := re.match(r"#\s?([a-z_]+) = ", line):
            keys.add(table + option.group(1))
    return keys


def test_every_option_appears_in_the_example() -> None:
    text = EXAMPLE.read_text()
    present = flattened_keys(tomllib.loads(text)) | commented_keys(text)
    missing = [key for key in settings_schema_keys() if key not in present]
    assert not missing, f"config/pigeon.toml does not document: {', '.join(missing)}"
