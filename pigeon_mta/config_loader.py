"""Loading settings: TOML file + environment -> one frozen, validated `Settings` value.

The values are built by walking the dataclasses of config.py (config_build.py), so adding an
option is adding a field there; an unknown key, a wrong type, a bad duration or a bad address is a
`ConfigError` whose message names the key. Rules that span fields are checked here, after the values are built.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from pigeon_mta.config import (
    API_LISTENER,
    LANE_HEADER_POLICIES,
    OUTBOX_LISTENER,
    DeliverySettings,
    HostPort,
    LaneHeader,
    LaneSettings,
    ServerSettings,
    Settings,
    default_lanes,
)
from pigeon_mta.config_build import ConfigError as ConfigError
from pigeon_mta.config_build import build
from pigeon_mta.config_build import settings_schema_keys as settings_schema_keys
from pigeon_mta.config_outbox import check_outboxes
from pigeon_mta.config_shaping import check_shaping
from pigeon_mta.config_values import nameserver_address
from pigeon_mta.domains import normalize_domain

ENV_CONFIG = "PIGEON_CONFIG"
ENV_DATABASE_URL = "PIGEON_DATABASE_URL"
ENV_DATA_DIR = "PIGEON_DATA_DIR"


def load_settings(
    path: str | Path | None = None, env: typing.Mapping[str, str] | None = None
) -> Settings:
    """Read `path` (else $PIGEON_CONFIG, else defaults), apply environment overrides, validate."""
    env = os.environ if env is None else env
    chosen = str(path) if path else env.get(ENV_CONFIG, "")
    data: dict[str, Any] = {}
    source = "built-in defaults"
    if chosen:
        try:
            with open(chosen, "rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {chosen} does not exist") from None
        except PermissionError:
            raise ConfigError(f"config file {chosen} is not readable") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {chosen} is a directory, not a file") from None
        except UnicodeDecodeError:
            # TOML is UTF-8 (TOML 1.0 "Spec"); tomllib lets the decoding error through.
            raise ConfigError(f"config file {chosen} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {chosen} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"config file {chosen} cannot be read: {exc.strerror}") from None
        source = chosen
    data, lane_header = _lane_header(data)
    settings = build(Settings, data, "")
    settings = dataclasses.replace(
        settings, lanes=_with_builtin_lanes(settings, data), lane_header=lane_header
    )
    url = env.get(ENV_DATABASE_URL, "")
    if url:
        settings = dataclasses.replace(
            settings, database=dataclasses.replace(settings.database, url=url)
        )
    data_dir = env.get(ENV_DATA_DIR, "")
    if data_dir:
        settings = dataclasses.replace(
            settings, server=dataclasses.replace(settings.server, data_dir=data_dir)
        )
    settings = dataclasses.replace(settings, source=source)
    _check(settings)
    assert isinstance(settings, Settings)
    return settings


def _lane_header(data: dict[str, Any]) -> tuple[dict[str, Any], LaneHeader]:
    """`[lanes] header` taken out of the [lanes] table, whose other keys are lane names."""
    lanes = data.get("lanes")
    if not isinstance(lanes, dict) or "header" not in lanes:
        return data, "lower"
    value = lanes["header"]
    if value not in LANE_HEADER_POLICIES:
        raise ConfigError(
            f"bad value for 'lanes.header': {value!r} is not one of "
            f"{', '.join(LANE_HEADER_POLICIES)}"
        )
    rest = {name: lane for name, lane in lanes.items() if name != "header"}
    return {**data, "lanes": rest}, typing.cast(LaneHeader, value)


def _with_builtin_lanes(settings: Settings, data: dict[str, Any]) -> dict[str, LaneSettings]:
    """The built-in lanes, each key a [lanes.NAME] entry sets replacing the built-in's value,
    then the lanes the file adds."""
    declared = data.get("lanes", {})
    lanes = default_lanes()
    for name, lane in settings.lanes.items():
        builtin = lanes.get(name)
        if builtin is None:
            lanes[name] = lane
            continue
        given = declared.get(name, {})
        lanes[name] = dataclasses.replace(
            builtin, **{f: getattr(lane, f) for f in given if hasattr(lane, f)}
        )
    return lanes


# A lane name as the X-Pigeon-Lane header, the CLI and metric labels carry it.
LANE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")


def _check_lanes(settings: Settings) -> None:
    for name, lane in settings.lanes.items():
        if not LANE_NAME.fullmatch(name):
            raise ConfigError(
                f"bad lane name 'lanes.{name}': use lower-case letters, digits, '.', '_' and '-' "
                "(at most 63, starting with a letter or digit)"
            )
        if lane.weight <= 0:
            raise ConfigError(f"'lanes.{name}.weight' must be more than zero")
        if lane.rate < 0:
            raise ConfigError(f"'lanes.{name}.rate' must not be negative")
        if lane.max_age < 0:
            raise ConfigError(f"'lanes.{name}.max_age' must not be negative")
    for listener in settings.listener:
        if listener.lane and listener.lane not in settings.lanes:
            known = ", ".join(sorted(settings.lanes))
            raise ConfigError(
                f"listener '{listener.name}': lane '{listener.lane}' is not a lane (lanes: {known})"
            )


def _check(settings: Settings) -> None:
    """Rules that span fields."""
    _check_names(settings.server)
    if "/" in settings.server.node_name:
        # A lease owner is "<node_name>/<run id>": the name must not look like a prefix of another.
        raise ConfigError(f"'server.node_name' must not contain '/': {settings.server.node_name!r}")
    _check_intervals(settings)
    for problem in (check_shaping(settings.shaping), check_outboxes(settings.outbox)):
        if problem is not None:
            raise ConfigError(problem)
    names = [listener.name for listener in settings.listener]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"listener name '{name}' is used twice")
        if name in (API_LISTENER, OUTBOX_LISTENER, "sendmail"):
            # API, outbox and sendmail mail is stored and counted under these names.
            raise ConfigError(
                f"listener name '{name}' is reserved for the HTTP API, outboxes and sendmail"
            )
    for listener in settings.listener:
        if bool(listener.tls_cert) != bool(listener.tls_key):
            raise ConfigError(
                f"listener '{listener.name}': set both tls_cert and tls_key, or neither"
            )
    _check_submission(settings)
    _check_lanes(settings)
    _check_api(settings)
    delivery = settings.delivery
    if delivery.retry_initial <= 0:
        raise ConfigError("'delivery.retry_initial' must be more than zero")
    if delivery.retry_max < delivery.retry_initial:
        raise ConfigError("'delivery.retry_max' must not be less than 'delivery.retry_initial'")
    if delivery.lease < 5:
        raise ConfigError("'delivery.lease' must be at least 5s")
    if delivery.batch_size < 1:
        raise ConfigError("'delivery.batch_size' must be at least 1")
    if delivery.relayhost:
        _check_host_port(delivery.relayhost, "delivery.relayhost", default_port=25)
    _check_outbound(delivery)
    for domain, target in delivery.routes.items():
        _check_host_port(target, f"delivery.routes.{domain}", default_port=25)
    for i, ns in enumerate(settings.dns.nameservers):
        try:
            nameserver_address(ns)
        except ValueError:
            raise ConfigError(
                f"bad value for 'dns.nameservers[{i}]': {ns!r} is not an IP address or ip:port"
            ) from None
    if settings.database.pool_size < 1:
        raise ConfigError("'database.pool_size' must be at least 1")
    _check_webhooks(settings)
    _check_bounces(settings)


def _check_bounces(settings: Settings) -> None:
    bounces = settings.bounces
    warn_after = bounces.delay_warning_after
    if warn_after < 0 or (warn_after > 0 and warn_after >= settings.delivery.max_age):
        raise ConfigError(
            "'bounces.delay_warning_after' must be 0 (no warnings) or less than "
            "'delivery.max_age' (the recipient expires then)"
        )
    if bounces.return_path_domain and normalize_domain(bounces.return_path_domain) is None:
        raise ConfigError(
            f"bad value for 'bounces.return_path_domain': {bounces.return_path_domain!r} is not "
            "a domain name (like bounces.example.com)"
        )
    for address in bounces.complaint_addresses:
        local, at, domain = address.rpartition("@")
        if not (at and local and normalize_domain(domain)) or any(c.isspace() for c in address):
            raise ConfigError(
                f"bad value in 'bounces.complaint_addresses': {address!r} is not an address"
            )
    if bounces.feedback_max_age <= 0:
        raise ConfigError("'bounces.feedback_max_age' must be more than zero")


# A host name as EHLO, Message-IDs and bounce senders use it: letters, digits, dots, hyphens
# (RFC 5321 4.1.2 Domain; underscores too, which container hosts are often named with).
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")


def _check_names(server: ServerSettings) -> None:
    if not _HOSTNAME.fullmatch(server.hostname):
        raise ConfigError(
            f"bad value for 'server.hostname': {server.hostname!r} is not a host name "
            "(letters, digits, dots and hyphens, like mta.example.com)"
        )
    if not server.node_name.strip() or not server.node_name.isprintable():
        raise ConfigError(
            f"bad value for 'server.node_name': {server.node_name!r} must be a non-empty name "
            "without control characters"
        )


# Durations for which zero makes no sense: a loop that waits this long between rounds would spin
# (stats_interval = 0 kept a core busy), and a zero timeout fails every operation at once.
_MORE_THAN_ZERO = (
    "api.read_timeout",
    "database.connect_timeout",
    "database.statement_timeout",
    "delivery.max_age",
    "delivery.poll_interval",
    "delivery.sweep_interval",
    "dns.timeout",
    "metrics.stats_interval",
    "webhooks.max_age",
    "webhooks.poll_interval",
    "webhooks.retry_initial",
    "webhooks.timeout",
)


def _check_intervals(settings: Settings) -> None:
    for key in _MORE_THAN_ZERO:
        section, name = key.split(".")
        if getattr(getattr(settings, section), name) <= 0:
            raise ConfigError(f"'{key}' must be more than zero")
    # PostgreSQL takes statement_timeout in milliseconds as a 32-bit integer.
    if settings.database.statement_timeout * 1000 > 2**31 - 1:
        raise ConfigError("'database.statement_timeout' must be at most 24d")


def _check_outbound(delivery: DeliverySettings) -> None:
    for key in (
        "concurrency",
        "destination_concurrency",
        "destination_concurrency_initial",
        "max_connections_per_host",
        "max_messages_per_connection",
    ):
        if getattr(delivery, key) < 1:
            raise ConfigError(f"'delivery.{key}' must be at least 1")
    for key in ("connect_timeout", "command_timeout", "data_timeout"):
        if getattr(delivery, key) <= 0:
            raise ConfigError(f"'delivery.{key}' must be more than zero")
    if bool(delivery.relayhost_username) != bool(delivery.relayhost_password):
        raise ConfigError(
            "set both 'delivery.relayhost_username' and 'delivery.relayhost_password', or neither"
        )
    if delivery.relayhost_username and delivery.relayhost_tls not in ("required", "verify"):
        raise ConfigError(
            "'delivery.relayhost_tls' must be verify when 'delivery.relayhost_username' is set "
            "(a password is never sent in plaintext)"
        )
    if (
        delivery.relayhost_username
        and delivery.relayhost_tls != "verify"
        and not delivery.relayhost_auth_insecure
    ):
        raise ConfigError(
            "'delivery.relayhost_tls' must be verify when 'delivery.relayhost_username' is set "
            "(required takes any certificate, so a man in the middle would collect the password; "
            "'delivery.relayhost_auth_insecure = true' allows it anyway)"
        )
    for pattern, dest in delivery.destination.items():
        if dest.rate < 0:
            raise ConfigError(f"'delivery.destination.{pattern}.rate' must not be negative")
    if not 0 < delivery.max_org_share <= 1:
        raise ConfigError("'delivery.max_org_share' must be more than 0 and at most 1")
    if not 0 < delivery.backoff_factor < 1:
        raise ConfigError("'delivery.backoff_factor' must be more than 0 and less than 1")
    if not 0 < delivery.backoff_step <= 1:
        raise ConfigError("'delivery.backoff_step' must be more than 0 and at most 1")
    if delivery.backoff_quiet <= 0:
        raise ConfigError("'delivery.backoff_quiet' must be more than zero")
    if delivery.park_after < 0:
        raise ConfigError("'delivery.park_after' must be 0 (never park) or more")
    if delivery.park_for <= 0 or delivery.park_max < delivery.park_for:
        raise ConfigError(
            "'delivery.park_for' must be more than zero and 'delivery.park_max' at least as long"
        )


def _check_webhooks(settings: Settings) -> None:
    webhooks = settings.webhooks
    # Each request in flight holds a task and a connection: thousands per endpoint is a mistake.
    if not 1 <= webhooks.concurrency_per_endpoint <= 1000:
        raise ConfigError("'webhooks.concurrency_per_endpoint' must be from 1 to 1000")
    if webhooks.retry_max < webhooks.retry_initial:
        raise ConfigError("'webhooks.retry_max' must not be less than 'webhooks.retry_initial'")


def _check_submission(settings: Settings) -> None:
    addresses = [str(listener.address) for listener in settings.listener]
    for listener in settings.listener:
        # SO_REUSEPORT would let both bind, and split the connections between them.
        if listener.address.port and addresses.count(str(listener.address)) > 1:
            raise ConfigError(f"two listeners use the address {listener.address}")
    limits = settings.limits
    for key in ("command_timeout", "data_timeout", "auth_failure_window", "credential_rate_window"):
        if getattr(limits, key) <= 0:
            raise ConfigError(f"'limits.{key}' must be more than zero")
    for key in ("max_from_addresses", "max_from_length"):
        if getattr(limits, key) < 1:
            raise ConfigError(f"'limits.{key}' must be at least 1")


def _check_api(settings: Settings) -> None:
    api = settings.api
    if bool(api.tls_cert) != bool(api.tls_key):
        raise ConfigError("set both 'api.tls_cert' and 'api.tls_key', or neither")
    if api.max_body_memory < 1:
        raise ConfigError("'api.max_body_memory' must be at least 1 (bytes)")
    taken = {str(listener.address) for listener in settings.listener}
    taken.add(str(settings.metrics.listen))
    if api.listen is not None and api.listen.port and str(api.listen) in taken:
        # SO_REUSEPORT would let both bind, and split the connections between them.
        raise ConfigError(f"'api.listen' {api.listen} is the address of a listener or of metrics")


def _check_host_port(value: str, key: str, default_port: int) -> None:
    try:
        HostPort.parse(value, default_port=default_port)
    except ValueError as exc:
        raise ConfigError(f"bad value for '{key}': {exc}") from None
