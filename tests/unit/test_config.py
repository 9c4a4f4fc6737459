"""Settings: defaults of the interface contract, parsing, and one clear error per mistake."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from pigeon_mta.config import Duration, HostPort
from pigeon_mta.config_loader import ConfigError, load_settings, settings_schema_keys


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return path


def test_builtin_defaults_match_the_contract() -> None:
    s = load_settings(None, env={})
    assert s.source == "built-in defaults"
    listeners = {x.name: x for x in s.listener}
    assert listeners["relay"].address == HostPort("127.0.0.1", 2525)
    assert listeners["relay"].mode == "relay"
    assert listeners["submission"].address == HostPort("127.0.0.1", 2587)
    assert listeners["submission"].mode == "submission"
    assert s.metrics.listen == HostPort("127.0.0.1", 9187)
    assert set(s.relay.trusted_networks) == {"127.0.0.0/8", "::1/128"}
    assert s.relay.trusted_org == "internal"
    assert s.database.url == ""
    assert s.delivery.retry_initial == 300 and s.delivery.retry_max == 3600
    assert s.delivery.max_age == 5 * 86400 and s.delivery.lease == 300


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30),
        ("5m", 300),
        ("1h", 3600),
        ("5d", 432000),
        ("2w", 1209600),
        ("45", 45),
        (12, 12),
        (1.5, 1.5),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert Duration.parse(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["5x", "", "m5", "-1s", True, "1 h h"])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ValueError):
        Duration.parse(bad)


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:25", "127.0.0.1", 25),
        ("[::1]:2525", "::1", 2525),
        ("mx.example:587", "mx.example", 587),
    ],
)
def test_addresses(text: str, host: str, port: int) -> None:
    assert HostPort.parse(text) == HostPort(host, port)


def test_file_overrides_and_env_database_url(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
hostname = "mta.example.com"
[[listener]]
name = "smtp"
address = "0.0.0.0:25"
mode = "relay"
[delivery]
retry_initial = "1m"
routes = { "corp.example" = "10.1.2.3:25" }
[dns]
nameservers = ["127.0.0.1:5353", "::1"]
""",
    )
    s = load_settings(path, env={"PIGEON_DATABASE_URL": "postgresql://u@db/pigeon"})
    assert s.server.hostname == "mta.example.com"
    assert [x.name for x in s.listener] == ["smtp"]
    assert s.delivery.retry_initial == 60
    assert s.delivery.routes == {"corp.example": "10.1.2.3:25"}
    assert s.database.url == "postgresql://u@db/pigeon"
    assert s.source == str(path)


def test_config_env_variable_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nhostname = "from-env.example"\n')
    assert (
        load_settings(None, env={"PIGEON_CONFIG": str(path)}).server.hostname == "from-env.example"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[server]\nhostnme = "x"\n', "unknown key 'server.hostnme'"),
        ('[sever]\nhostname = "x"\n', "unknown key 'sever'"),
        (
            '[[listener]]\nname="a"\naddress="127.0.0.1:25"\nport=2\n',
            "unknown key 'listener[0].port'",
        ),
        ('[delivery]\nretry_initial = "5 minutes"\n', "'delivery.retry_initial'"),
        ('[metrics]\nlisten = "localhost"\n', "'metrics.listen'"),
        ('[[listener]]\nname="a"\naddress="127.0.0.1:99999"\n', "'listener[0].address'"),
        ('[[listener]]\nname="a"\naddress="127.0.0.1:25"\nmode="smtp"\n', "'listener[0].mode'"),
        ('[relay]\ntrusted_networks = ["10.0.0.0/33"]\n', "'relay.trusted_networks[0]'"),
        ('[limits]\nmax_recipients = "many"\n', "'limits.max_recipients'"),
        ('[delivery]\nrelayhost = "smtp.example:x"\n', "'delivery.relayhost'"),
        ('[dns]\nnameservers = ["resolver.example"]\n', "'dns.nameservers[0]'"),
        ("[server\n", "not valid TOML"),
        ('[limits]\nlong_lines = "wrap"\n', "'limits.long_lines'"),
        (
            '[delivery]\nmax_age = "1d"\n[bounces]\ndelay_warning_after = "1d"\n',
            "'bounces.delay_warning_after' must be 0 (no warnings) or less than",
        ),
    ],
)
def test_each_mistake_names_its_key(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), env={})
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", env={})


def test_schema_keys_cover_sections() -> None:
    keys = settings_schema_keys()
    for key in (
        "server.hostname",
        "database.url",
        "listener.address",
        "relay.trusted_org",
        "delivery.routes",
        "dns.nameservers",
        "metrics.listen",
        "limits.max_message_size",
    ):
        assert key in keys


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[[listener]]\nname = "a"\naddress = "127.0.0.1:2525"\n'
            '[[listener]]\nname = "b"\naddress = "127.0.0.1:2525"\nmode = "submission"\n',
            "two listeners use the address 127.0.0.1:2525",
        ),
        ('[limits]\ncommand_timeout = "0s"\n', "'limits.command_timeout' must be more than zero"),
        ('[relay]\nsender_policy = "lax"\n', "bad value for 'relay.sender_policy'"),
    ],
)
def test_submission_settings_are_checked(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_settings(write(tmp_path, text), env={})


def test_submission_defaults() -> None:
    s = load_settings(None, env={})
    assert s.relay.sender_policy == "strict"
    assert (s.limits.max_auth_failures, s.limits.auth_failure_window) == (5, 600)
    assert s.limits.credential_rate_limit == 0


def test_node_name_defaults_to_the_hostname_and_must_not_contain_a_slash(tmp_path: Path) -> None:
    """Lease owners are "<node_name>/<run id>": "a" must not be a prefix of another node's."""
    assert load_settings(None, env={}).server.node_name == socket.gethostname()
    with pytest.raises(ConfigError, match=r"'server.node_name' must not contain '/'"):
        load_settings(write(tmp_path, '[server]\nnode_name = "a/b"\n'), env={})


def test_lanes_keep_the_builtins_and_a_lane_max_age_replaces_delivery_max_age(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pigeon.toml"
    path.write_text(
        '[delivery]\nmax_age = "5d"\n'
        '[lanes.bulk]\nmax_age = "2d"\n'
        "[lanes.notify]\nweight = 5\n"
        '[[listener]]\nname = "app"\naddress = "127.0.0.1:2600"\nmode = "relay"\nlane = "notify"\n'
    )
    settings = load_settings(path)
    assert sorted(settings.lanes) == ["bulk", "notify", "transactional"]
    # A key the file leaves out keeps the built-in lane's value.
    assert (settings.lanes["bulk"].weight, settings.lanes["transactional"].weight) == (1, 10)
    assert settings.max_age_of("bulk") == 2 * 86400
    assert settings.max_age_of("transactional") == settings.max_age_of("gone") == 5 * 86400
    assert settings.listener[0].lane == "notify"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[lanes.Bulk]\nweight = 1\n", "bad lane name 'lanes.Bulk'"),
        ("[lanes.bulk]\nweight = 0\n", "'lanes.bulk.weight' must be more than zero"),
        ("[lanes.bulk]\nrate = -1\n", "'lanes.bulk.rate' must not be negative"),
        (
            '[[listener]]\nname = "x"\naddress = "127.0.0.1:2600"\nmode = "relay"\nlane = "nope"\n',
            "listener 'x': lane 'nope' is not a lane (lanes: bulk, transactional)",
        ),
    ],
)
def test_lane_mistakes_name_their_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_settings(path)


def test_api_listens_on_8025_by_default_and_takes_a_certificate_with_its_key(
    tmp_path: Path,
) -> None:
    s = load_settings(None, env={})
    assert (s.api.listen, s.api.tls_cert, s.api.tls_key) == (HostPort("127.0.0.1", 8025), "", "")
    s = load_settings(
        write(tmp_path, '[api]\nlisten = "[::1]:8443"\ntls_cert = "c.pem"\ntls_key = "k.pem"\n'),
        env={},
    )
    assert (s.api.listen, s.api.tls_cert, s.api.tls_key) == (
        HostPort("::1", 8443),
        "c.pem",
        "k.pem",
    )
    assert s.api.read_timeout == 30
    s = load_settings(write(tmp_path, '[api]\nread_timeout = "5s"\n'), env={})
    assert s.api.read_timeout == 5


def test_an_empty_api_listen_is_no_api_and_takes_no_address(tmp_path: Path) -> None:
    # The API's default address is free for metrics once the API has none.
    text = '[api]\nlisten = ""\n[metrics]\nlisten = "127.0.0.1:8025"\n'
    s = load_settings(write(tmp_path, text), env={})
    assert s.api.listen is None
    assert s.metrics.listen == HostPort("127.0.0.1", 8025)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[api]\ntls_cert = "c.pem"\n', "set both 'api.tls_cert' and 'api.tls_key', or neither"),
        ('[api]\ntls_key = "k.pem"\n', "set both 'api.tls_cert' and 'api.tls_key', or neither"),
        ('[api]\nlisten = "8025"\n', "bad value for 'api.listen'"),
        ('[api]\nlisten = " "\n', "bad value for 'api.listen'"),
        ("[api]\nlisten = 8025\n", "bad value for 'api.listen'"),
        ('[api]\nread_timeout = "0s"\n', "'api.read_timeout' must be more than zero"),
        ('[api]\nlistn = "127.0.0.1:8025"\n', "unknown key 'api.listn'"),
        (
            '[api]\nlisten = "127.0.0.1:9187"\n',
            "'api.listen' 127.0.0.1:9187 is the address of a listener or of metrics",
        ),
    ],
)
def test_api_mistakes_name_their_key(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), env={})
    assert expected in str(info.value)


def test_the_environment_names_the_data_directory(tmp_path: Path) -> None:
    """$PIGEON_DATA_DIR overrides `[server] data_dir` (a container's volume, a test's own
    directory), as $PIGEON_DATABASE_URL overrides the database."""
    path = tmp_path / "pigeon.toml"
    path.write_text('[server]\ndata_dir = "/srv/pigeon"\n')
    assert load_settings(path, env={}).server.data_dir == "/srv/pigeon"
    moved = load_settings(path, env={"PIGEON_DATA_DIR": str(tmp_path / "data")})
    assert moved.server.data_dir == str(tmp_path / "data")


OUTBOX = '[[outbox]]\nname = "shop"\ndatabase = "postgresql://shop@db/shop"\norg = "acme"\n'


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('table = "Orders; DROP TABLE x"\n', r"bad 'outbox\[0\].table'"),
        ("batch = 0\n", r"'outbox\[0\].batch' must be 1 to 1000"),
        ('poll_interval = "0s"\n', "must be more than zero"),
        ("\n" + OUTBOX, "outbox name 'shop' is used twice"),
    ],
)
def test_outbox_settings_are_checked(tmp_path: Path, extra: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_settings(write(tmp_path, OUTBOX + extra), env={})


def test_an_outbox_needs_its_database_and_org(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing key 'outbox\[0\].database'"):
        load_settings(write(tmp_path, '[[outbox]]\nname = "shop"\norg = "acme"\n'), env={})
    settings = load_settings(write(tmp_path, OUTBOX + 'table = "app.pigeon_outbox"\n'), env={})
    [outbox] = settings.outbox
    assert (outbox.table, outbox.batch, outbox.retention) == ("app.pigeon_outbox", 200, 7 * 86400)
