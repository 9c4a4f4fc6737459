"""The value types settings are written in, each parsing its own config text: durations ("30s",
"5m"), host:port addresses, IP networks, DNS servers and route targets (config.py types its
options with them; config_loader.py calls their parsers).
"""

from __future__ import annotations

import ipaddress
import math
import re
import typing
from dataclasses import dataclass

from pigeon_mta.plain import is_digits


class Duration(float):
    """Seconds, written in config as "250ms", "30s", "5m", "1h", "5d" or a bare number of seconds."""

    _UNITS: typing.ClassVar[dict[str, float]] = {
        "ms": 0.001,
        "s": 1,
        "m": 60,
        "h": 3600,
        "d": 86400,
        "w": 604800,
    }
    _PATTERN: typing.ClassVar[re.Pattern[str]] = re.compile(
        r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)?\s*$"
    )

    # The longest duration accepted: longer ones are typing mistakes, and timers, timedelta and
    # PostgreSQL intervals overflow somewhere beyond. nan and inf are refused outright: a nan
    # timeout or lease compares false with everything, and stopped connections or delivery.
    MAX: typing.ClassVar[float] = 100 * 365 * 86400.0

    @classmethod
    def parse(cls, value: object) -> Duration:
        if isinstance(value, bool):
            raise ValueError("expected a duration like 30s, 5m, 1h or 5d")
        if isinstance(value, int | float):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{value!r} is not a duration like 30s, 5m, 1h or 5d")
            if value < 0:
                raise ValueError("a duration cannot be negative")
            if value > cls.MAX:  # compared before float(): a huge int does not fit in one
                raise ValueError("a duration cannot be longer than 100 years")
            return cls(value)
        if isinstance(value, str):
            match = cls._PATTERN.match(value)
            if match:
                seconds = float(match.group(1)) * cls._UNITS[match.group(2) or "s"]
                if seconds > cls.MAX:
                    raise ValueError("a duration cannot be longer than 100 years")
                return cls(seconds)
        raise ValueError(f"{value!r} is not a duration like 30s, 5m, 1h or 5d")


@dataclass(frozen=True)
class HostPort:
    """An "ip:port", "[v6]:port" or "host:port" address."""

    host: str
    port: int

    @classmethod
    def parse(cls, value: object, default_port: int | None = None) -> HostPort:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{value!r} is not an address like 127.0.0.1:2525 or [::1]:2525")
        text = value.strip()
        host, port_text = text, ""
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise ValueError(f"{value!r} has an unclosed '['")
            host, rest = text[1:end], text[end + 1 :]
            if rest and not rest.startswith(":"):
                raise ValueError(f"{value!r} is not an address like [::1]:2525")
            port_text = rest[1:]
        elif text.count(":") == 1:
            host, port_text = text.split(":")
        elif text.count(":") > 1:
            raise ValueError(f"{value!r}: write an IPv6 address with a port as [addr]:port")
        if not host:
            raise ValueError(f"{value!r} has no host")
        if not host.isprintable() or any(c.isspace() for c in host):
            raise ValueError(f"{value!r} has spaces or control characters in its host")
        if not port_text:
            if default_port is None:
                raise ValueError(f"{value!r} has no port (write host:port)")
            return cls(host, default_port)
        if not is_digits(port_text) or not 0 < int(port_text) < 65536:
            raise ValueError(f"{value!r} has an invalid port {port_text!r}")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Network(str):
    """An IP network in CIDR form ("10.0.0.0/8", "::1/128"); a bare address means one host."""

    @classmethod
    def parse(cls, value: object) -> Network:
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a network like 10.0.0.0/8")
        try:
            return cls(str(ipaddress.ip_network(value.strip(), strict=False)))
        except ValueError:
            raise ValueError(f"{value!r} is not a network like 10.0.0.0/8") from None


def nameserver_address(value: str) -> HostPort:
    """A `dns.nameservers` entry: "ip" (port 53), "ip:port" or "[v6]:port"."""
    try:
        return HostPort(str(ipaddress.ip_address(value.strip())), 53)
    except ValueError:
        hp = HostPort.parse(value, default_port=53)
        ipaddress.ip_address(hp.host)
        return hp


def route_target(value: str, default_port: int = 25) -> HostPort:
    """Parse a route or relayhost value already validated by load_settings."""
    return HostPort.parse(value, default_port=default_port)
