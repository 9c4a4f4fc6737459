"""The real command: config mistakes give one sentence on stderr and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_pigeon


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[server]\nhostnme = "x"\n', "unknown key 'server.hostnme'"),
        ('[delivery]\nmax_age = "forever"\n', "bad value for 'delivery.max_age'"),
        (
            '[[listener]]\nname = "x"\naddress = "127.0.0.1"\n',
            "bad value for 'listener[0].address'",
        ),
    ],
)
def test_check_config_rejects_with_exit_2(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = run_pigeon("check-config", str(path))
    assert result.returncode == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_config_errors_stop_other_commands_too(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[delivery]\nlease = "1 fortnight"\n')
    result = run_pigeon("org", "list", "--config", str(path))
    assert result.returncode == 2
    assert "'delivery.lease'" in result.stderr


def test_check_config_accepts_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "good.toml"
    path.write_text('[server]\nhostname = "mta.example.com"\n')
    result = run_pigeon("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


RELAYHOST_AUTH = (
    '[delivery]\nrelayhost = "smtp.example:587"\nrelayhost_username = "u"\n'
    'relayhost_password = "p"\nrelayhost_tls = "required"\n'
)


def test_check_config_refuses_relayhost_auth_to_any_certificate(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(RELAYHOST_AUTH)
    result = run_pigeon("check-config", str(path))
    assert result.returncode == 2
    for key in ("delivery.relayhost_tls", "delivery.relayhost_username", "relayhost_auth_insecure"):
        assert key in result.stderr


def test_check_config_warns_about_the_insecure_relayhost_opt_out(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(RELAYHOST_AUTH + "relayhost_auth_insecure = true\n")
    result = run_pigeon("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "pigeon-mta: warning: the relayhost password goes to any certificate" in result.stderr
    assert "ok" in result.stdout


def test_check_config_lists_the_lanes_and_the_listeners_lane(tmp_path: Path) -> None:
    path = tmp_path / "lanes.toml"
    path.write_text(
        '[lanes.bulk]\nrate = 20\nmax_age = "2d"\n[lanes.notify]\nweight = 5\n'
        '[[listener]]\nname = "news"\naddress = "127.0.0.1:2600"\nmode = "relay"\nlane = "bulk"\n'
    )
    result = run_pigeon("check-config", str(path), "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["lanes"] == (
        "bulk (weight 1, rate 20/s, max_age 2d), notify (weight 5), transactional (weight 10)"
    )
    assert shown["listeners"] == "news=127.0.0.1:2600/relay (lane bulk)"
    assert shown["api"] == "http://127.0.0.1:8025"
