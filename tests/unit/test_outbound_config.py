"""The outbound settings: per-destination tables, TLS policies, relayhost AUTH rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon_mta.config import DestinationSettings, Settings
from pigeon_mta.config_loader import ConfigError, load_settings
from pigeon_mta.config_review import config_warnings


def relayhost_warnings(settings: Settings) -> list[str]:
    return [w for w in config_warnings(settings) if "relayhost" in w]


def test_destination_tables_and_outbound_keys(tmp_path: Path) -> None:
    settings = load_settings(
        _write(
            tmp_path,
            """
[delivery]
tls = "verify"
ip_preference = "ipv6"
concurrency = 50
idle_timeout = "10s"
[delivery.destination."*.google.com"]
concurrency = 5
rate = 2.5
burst = 10
[delivery.destination."partner.example"]
tls = "none"
[dns]
nameservers = ["127.0.0.1:5353"]
timeout = "3s"
""",
        ),
        env={},
    )
    delivery = settings.delivery
    assert (delivery.tls, delivery.ip_preference, delivery.concurrency) == ("verify", "ipv6", 50)
    assert delivery.idle_timeout == 10
    assert delivery.destination == {
        "*.google.com": DestinationSettings(concurrency=5, rate=2.5, burst=10),
        "partner.example": DestinationSettings(tls="none"),
    }
    assert settings.dns.timeout == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[delivery]\ntls = "sometimes"', "'delivery.tls'"),
        ('[delivery.destination."x.example"]\nspeed = 3', "'delivery.destination.x.example.speed'"),
        ('[delivery.destination."x.example"]\ntls = "maybe"', "delivery.destination.x.example.tls"),
        ("[delivery]\nconcurrency = 0", "'delivery.concurrency' must be at least 1"),
        (
            "[delivery]\ndestination_concurrency_initial = 0",
            "'delivery.destination_concurrency_initial' must be at least 1",
        ),
        ("[delivery]\nadaptive_concurrency = 1", "'delivery.adaptive_concurrency'"),
        ('[delivery]\nrelayhost_username = "u"', "relayhost_password"),
        (
            '[delivery]\nrelayhost = "smtp.example:587"\nrelayhost_username = "u"\n'
            'relayhost_password = "p"',
            "never sent in plaintext",
        ),
        ('[delivery]\nip_preference = "ipv5"', "'delivery.ip_preference'"),
        ("[delivery]\nbackoff_factor = 1", "'delivery.backoff_factor' must be more than 0"),
        ("[delivery]\nbackoff_step = 0", "'delivery.backoff_step' must be more than 0"),
        ('[delivery]\nbackoff_quiet = "0"', "'delivery.backoff_quiet' must be more than zero"),
    ],
)
def test_mistakes_name_their_key(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_write(tmp_path, text), env={})
    assert expected in str(info.value)


RELAYHOST_AUTH = '[delivery]\nrelayhost = "smtp.example:587"\nrelayhost_username = "u"\nrelayhost_password = "p"\n'


def test_relayhost_auth_over_tls_that_takes_any_certificate_is_refused(tmp_path: Path) -> None:
    """`required` takes any certificate: a man in the middle would collect the password."""
    with pytest.raises(ConfigError) as info:
        load_settings(_write(tmp_path, RELAYHOST_AUTH + 'relayhost_tls = "required"\n'), env={})
    for key in ("delivery.relayhost_tls", "delivery.relayhost_username", "relayhost_auth_insecure"):
        assert key in str(info.value)


def test_relayhost_auth_over_verified_tls_is_accepted_without_a_warning(tmp_path: Path) -> None:
    settings = load_settings(
        _write(tmp_path, RELAYHOST_AUTH + 'relayhost_tls = "verify"\n'), env={}
    )
    assert settings.delivery.relayhost_tls == "verify"
    assert relayhost_warnings(settings) == []


def test_the_insecure_opt_out_allows_required_tls_with_a_warning(tmp_path: Path) -> None:
    text = RELAYHOST_AUTH + 'relayhost_tls = "required"\nrelayhost_auth_insecure = true\n'
    settings = load_settings(_write(tmp_path, text), env={})
    [warning] = relayhost_warnings(settings)
    assert "relayhost_auth_insecure" in warning and "password" in warning


def test_the_insecure_opt_out_never_allows_plaintext(tmp_path: Path) -> None:
    text = RELAYHOST_AUTH + 'relayhost_tls = "opportunistic"\nrelayhost_auth_insecure = true\n'
    with pytest.raises(ConfigError, match="never sent in plaintext"):
        load_settings(_write(tmp_path, text), env={})


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return path
