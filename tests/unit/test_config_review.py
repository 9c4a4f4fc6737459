"""What check-config and serve's start say about settings that load but are probably wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon_mta.config import Settings
from pigeon_mta.config_loader import load_settings
from pigeon_mta.config_review import config_warnings, routing_summary
from tests.conftest import run_pigeon

CERT = (
    'tls_cert = "/etc/pigeon-mta/tls/fullchain.pem"\ntls_key = "/etc/pigeon-mta/tls/privkey.pem"\n'
)


def settings(tmp_path: Path, text: str, hostname: str = "mta.example.com") -> Settings:
    path = tmp_path / "pigeon.toml"
    path.write_text(f'[server]\nhostname = "{hostname}"\n{text}')
    return load_settings(path, env={})


def relay(address: str, networks: str) -> str:
    return (
        f'[[listener]]\nname = "relay"\naddress = "{address}"\nmode = "relay"\n{CERT}'
        f"[relay]\ntrusted_networks = [{networks}]\n"
    )


@pytest.mark.parametrize(
    ("networks", "expected"),
    [
        ('"0.0.0.0/0"', "includes 0.0.0.0/0, which covers public addresses"),
        ('"::/0"', "includes ::/0, which covers public addresses"),
        ('"192.168.0.0/16", "8.8.8.0/24"', "includes 8.8.8.0/24, which covers public addresses"),
        ('"172.17.0.0/16"', "includes 172.17.0.0/16, which overlaps Docker's bridge networks"),
        ('"172.16.0.0/12"', "includes 172.16.0.0/12, which overlaps Docker's bridge networks"),
        ('"10.88.0.0/16"', "includes 10.88.0.0/16, which overlaps Podman's default network"),
        ('"10.0.0.0/8"', "includes 10.0.0.0/8, which overlaps Podman's default network"),
    ],
)
def test_trusted_networks_that_open_the_relay_are_warned_about(
    tmp_path: Path, networks: str, expected: str
) -> None:
    warnings = config_warnings(settings(tmp_path, relay("0.0.0.0:25", networks)))
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"'relay.trusted_networks' {expected}")
    assert "listener 'relay' (0.0.0.0:25)" in warnings[0]


@pytest.mark.parametrize(
    ("address", "networks"),
    [
        ("0.0.0.0:25", '"127.0.0.0/8", "::1/128", "192.168.10.0/24", "10.1.0.0/16"'),
        ("0.0.0.0:25", '"fd12:3456::/48"'),
        # The same wide networks on a loopback listener: only local clients reach it.
        ("127.0.0.1:25", '"0.0.0.0/0", "172.17.0.0/16"'),
        ("[::1]:25", '"::/0"'),
    ],
)
def test_site_networks_and_loopback_listeners_are_not_warned_about(
    tmp_path: Path, address: str, networks: str
) -> None:
    assert config_warnings(settings(tmp_path, relay(address, networks))) == []


@pytest.mark.parametrize(
    ("hostname", "problem"),
    [
        ("localhost", "'server.hostname' is localhost: "),
        ("localhost.localdomain", "'server.hostname' is localhost.localdomain: "),
        ("vm", "'server.hostname' 'vm' has no dot: "),
    ],
)
def test_a_local_or_dotless_hostname_is_warned_about(
    tmp_path: Path, hostname: str, problem: str
) -> None:
    (warning,) = config_warnings(settings(tmp_path, relay("127.0.0.1:25", ""), hostname))
    assert warning.startswith(problem)
    assert f"MAILER-DAEMON@{hostname}" in warning and "EHLO" in warning


def test_listeners_without_a_certificate_are_named_in_one_warning(tmp_path: Path) -> None:
    text = "".join(
        f'[[listener]]\nname = "{m}"\naddress = "127.0.0.1:{p}"\nmode = "{m}"\n'
        for m, p in (("submission", 2587), ("submissions", 2465))
    )
    (warning,) = config_warnings(settings(tmp_path, text))
    assert warning.startswith("listeners submission, submissions have no tls_cert/tls_key")
    assert "the self-signed certificate" in warning and "selfsigned.pem" in warning


@pytest.mark.parametrize(
    ("text", "summary"),
    [
        ("", "everything to the recipient domains' MX hosts on port 25"),
        (
            '[delivery]\nrelayhost = "smtp.example.net:587"\nrelayhost_tls = "verify"\n'
            'relayhost_username = "u"\nrelayhost_password = "secret"\n'
            '[delivery.routes]\n"corp.example" = "10.1.2.3:25"\n',
            "static routes corp.example -> 10.1.2.3:25; everything else through relayhost "
            "smtp.example.net:587 (TLS verify, AUTH as u)",
        ),
        ("[delivery]\nenabled = false\n", "off on this node (delivery.enabled = false)"),
    ],
)
def test_the_routing_in_effect_is_one_line(tmp_path: Path, text: str, summary: str) -> None:
    assert routing_summary(settings(tmp_path, text)) == summary


def test_check_config_prints_warnings_on_stderr_and_still_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "open.toml"
    path.write_text('[server]\nhostname = "localhost"\n' + relay("0.0.0.0:2525", '"0.0.0.0/0"'))
    result = run_pigeon("check-config", str(path))
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.splitlines()
    assert len(warnings) == 2
    assert warnings[0].startswith("pigeon-mta: warning: 'server.hostname' is localhost")
    assert warnings[1].startswith(
        "pigeon-mta: warning: 'relay.trusted_networks' includes 0.0.0.0/0"
    )
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert lines["status"] == "ok"
    assert lines["delivery"] == "everything to the recipient domains' MX hosts on port 25"
    assert "keys_known" not in result.stdout


@pytest.mark.parametrize(
    ("api", "warned"),
    [
        ('listen = "0.0.0.0:8025"\n', True),
        ('listen = "[::]:8025"\n', True),
        ('listen = "127.0.0.1:8025"\n', False),
        ('listen = "localhost:8025"\n', False),
        ('listen = ""\n', False),
        (f'listen = "0.0.0.0:8025"\n{CERT}', False),
    ],
)
def test_a_plain_http_api_off_loopback_is_warned_about(
    tmp_path: Path, api: str, warned: bool
) -> None:
    got = [w for w in config_warnings(settings(tmp_path, f"[api]\n{api}")) if "HTTP API" in w]
    if warned:
        assert len(got) == 1 and "speaks plain HTTP" in got[0] and "api.tls_cert" in got[0]
    else:
        assert got == []
