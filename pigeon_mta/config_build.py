"""Building a config.py dataclass from the values a TOML file gave: the types each field declares
(durations, addresses, networks, literals, lists, tables, nested dataclasses) checked and
converted, with a `ConfigError` naming the dotted key of anything unknown, missing or wrong.
config_loader.py reads the file and checks the rules that span fields."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from pigeon_mta.config import Duration, HostPort, Network, Settings


class ConfigError(Exception):
    """A configuration problem, worded as one sentence for the operator."""


# Fields that are not read from the file by their own name (lane_header is [lanes] header).
INTERNAL_FIELDS = {"source", "lane_header"}


def settings_schema_keys(cls: type = Settings, prefix: str = "") -> list[str]:
    """Every dotted key the file may set (used to check that the example config documents all)."""
    keys: list[str] = ["lanes.header"] if cls is Settings else []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in INTERNAL_FIELDS:
            continue
        name = f"{prefix}{f.name}"
        inner = _dataclass_of(hints[f.name])
        if inner is not None:
            keys.extend(settings_schema_keys(inner, name + "."))
        else:
            keys.append(name)
    return keys


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type) and tp is not HostPort:
        return tp
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]) and args[0] is not HostPort:
            return typing.cast(type, args[0])
    return None


def build(cls: type, data: Any, path: str) -> Any:
    where = path or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in INTERNAL_FIELDS}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key '{path}{key}' (known keys here: {known})")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{path}{name}"
        if name in data:
            values[name] = _convert(hints[name], data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key '{key}'")
    return cls(**values)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    try:
        if tp is Duration:
            return Duration.parse(value)
        if tp is HostPort:
            return HostPort.parse(value)
        if tp is Network:
            return Network.parse(value)
        if dataclasses.is_dataclass(tp):
            return build(typing.cast(type, tp), value, key + ".")
        if origin is Literal:
            choices = typing.get_args(tp)
            if value not in choices:
                raise ValueError(f"{value!r} is not one of {', '.join(map(str, choices))}")
            return value
        if origin is tuple:
            item_type = typing.get_args(tp)[0]
            if not isinstance(value, list):
                raise ValueError("expected a list")
            return tuple(_convert(item_type, item, f"{key}[{i}]") for i, item in enumerate(value))
        if origin is dict:
            if not isinstance(value, dict):
                raise ValueError("expected a table")
            value_type = typing.get_args(tp)[1]
            return {str(k): _convert(value_type, v, f"{key}.{k}") for k, v in value.items()}
        if origin in (typing.Union, types.UnionType):
            if set(typing.get_args(tp)) == {HostPort, type(None)}:
                # An address that may be switched off, as a string option is: "" is none.
                return None if value == "" else HostPort.parse(value)
            return value
        if tp is bool:
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("expected a whole number")
            if value < 0:
                raise ValueError("expected a number that is not negative")
            if value >= 2**63:  # PostgreSQL's bigint, and far beyond any sensible setting
                raise ValueError("expected a number below 2**63")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError("expected a number")
            if (isinstance(value, int) and abs(value) > 2**53) or not math.isfinite(value):
                raise ValueError("expected a finite number")
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"bad value for '{key}': {exc}") from None
    raise ConfigError(f"'{key}' has a type the loader does not know ({tp})")
