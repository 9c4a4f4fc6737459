"""Values that load without complaint but break the service at run time are refused, each with one
sentence that names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon_mta.config_loader import ConfigError, load_settings
from tests.conftest import run_pigeon


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return load_settings(path, env={})


HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # TOML floats nan and inf: a nan command_timeout aborted every connection, a nan lease
        # stopped all delivery.
        ("[limits]\ncommand_timeout = nan\n", "limits.command_timeout"),
        ("[delivery]\nlease = nan\n", "delivery.lease"),
        ("[delivery]\nmax_age = inf\n", "delivery.max_age"),
        ("[delivery]\nretry_max = -inf\n", "delivery.retry_max"),
        (f"[delivery]\nmax_age = {HUGE}\n", "delivery.max_age"),
        (f'[delivery]\nmax_age = "{HUGE}s"\n', "delivery.max_age"),
        (f'[retention]\nmessages = "{HUGE}d"\n', "retention.messages"),
        (f"[limits]\nmax_message_size = {HUGE}\n", "limits.max_message_size"),
        (f'[delivery.destination."x.example"]\nrate = {HUGE}\n', "delivery.destination"),
        ('[delivery.destination."x.example"]\nrate = nan\n', "delivery.destination"),
        ('[database]\nstatement_timeout = "30d"\n', "database.statement_timeout"),
        (f"[webhooks]\nconcurrency_per_endpoint = {2**40}\n", "webhooks.concurrency_per_endpoint"),
        ("[webhooks]\nconcurrency_per_endpoint = 0\n", "webhooks.concurrency_per_endpoint"),
        ('[webhooks]\nretry_initial = "1h"\nretry_max = "1m"\n', "webhooks.retry_max"),
    ],
)
def test_non_finite_and_absurd_numbers_are_refused(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as caught:
        load(tmp_path, text)
    assert len(str(caught.value)) < 200  # one sentence, not the 400 digits back


@pytest.mark.parametrize(
    "key",
    [
        "delivery.sweep_interval",
        "delivery.poll_interval",
        "metrics.stats_interval",
        "dns.timeout",
        "database.connect_timeout",
        "database.statement_timeout",
        "delivery.max_age",
        "webhooks.max_age",
        "webhooks.poll_interval",
        "webhooks.retry_initial",
        "webhooks.timeout",
    ],
)
def test_zero_is_refused_where_it_would_spin_or_fail_everything(tmp_path: Path, key: str) -> None:
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"'{section}\.{name}' must be more than zero"):
        load(tmp_path, f'[{section}]\n{name} = "0s"\n')


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[server]\nhostname = "mta.example.com\\r\\nX-Injected: yes"\n', "server.hostname"),
        ('[server]\nhostname = "mta.example.com\\n"\n', "server.hostname"),
        ('[server]\nhostname = ""\n', "server.hostname"),
        ('[server]\nhostname = "mta example.com"\n', "server.hostname"),
        ('[server]\nnode_name = ""\n', "server.node_name"),
        ('[server]\nnode_name = "  "\n', "server.node_name"),
        ('[server]\nnode_name = "a\\rb"\n', "server.node_name"),
        ('[delivery]\nrelayhost = "smtp.example.com\\r\\n:25"\n', "delivery.relayhost"),
        ('[delivery.routes]\n"corp.example" = "10.0.0.1\\n:25"\n', "delivery.routes"),
    ],
)
def test_names_with_control_characters_or_empty_are_refused(
    tmp_path: Path, text: str, key: str
) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(tmp_path, text)


def test_a_plain_host_name_and_node_name_load(tmp_path: Path) -> None:
    settings = load(tmp_path, '[server]\nhostname = "mta-1.example.com"\nnode_name = "node_1"\n')
    assert settings.server.hostname == "mta-1.example.com"  # type: ignore[attr-defined]


def test_a_file_that_is_not_utf8_is_one_sentence_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[server]\nhostname = "mta.exämple.com"\n'.encode("latin-1"))
    result = run_pigeon("check-config", str(path))
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"pigeon-mta: config error: config file {path} is not UTF-8 text"
    )


def test_a_directory_as_the_config_is_one_sentence_not_a_traceback(tmp_path: Path) -> None:
    result = run_pigeon("check-config", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"pigeon-mta: config error: config file {tmp_path} is a directory, not a file"
    )
