"""A real `pigeon-mta serve` whose `[delivery] relayhost` is an aiosmtpd sink on 127.0.0.2: the
set-up the smarthost tests (Exim, Postfix), README's client examples and the HTTP API tests share.

    async with relay_serve(tmp_path, db_url, node_name="e2e-x", user=("app", PASSWORD)) as relay:
        ... send to 127.0.0.1:relay.submission_port or relay.api_url ...
        await relay.sink.wait_for(...)
    assert relay.exit_code == 0, relay.serve.output
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port, run_pigeon
from tests.e2e.serve_process import ServeProcess, write_config
from tests.integration.submission_helpers import ServerTLS
from tests.peers.smtp_sink import SinkState, start_sink, stop_servers

# What a test may add to a table: values as TOML writes them (strings quoted, numbers and booleans
# bare).
Table = Mapping[str, str | int | float | bool]


@dataclass
class Relay:
    config: Path
    serve: ServeProcess
    sink: SinkState
    submission_port: int | None
    api_port: int | None
    prepared: list[str]  # what each `setup` command printed
    exit_code: int | None = None  # serve's, once the block has left

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"


def _key(name: str) -> str:
    """A key as TOML writes it: bare when it may be, else quoted ("dest.test")."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _toml(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    return repr(value)


def relay_config(
    directory: Path,
    db_url: str,
    *,
    node_name: str,
    relayhost: str,
    submission_port: int | None = None,
    tls: ServerTLS | None = None,
    api_port: int | None = None,
    tables: Mapping[str, Table] | None = None,
    listeners: Sequence[Table] = (),
    outboxes: Sequence[Table] = (),
) -> Path:
    """The config: one `submission` listener on `submission_port` (its certificate `tls`, else the
    self-signed one) or none, and `listeners`; the API on `api_port` or none, mail to
    `relayhost`, no delivery log; `tables` adds keys to these tables or adds tables; `outboxes`
    are [[outbox]] entries."""
    listener: dict[str, str | int | float | bool] = {}
    if submission_port is not None:
        listener = {
            "name": "submission",
            "address": f"127.0.0.1:{submission_port}",
            "mode": "submission",
        }
        if tls is not None:
            listener |= {"tls_cert": str(tls.cert_file), "tls_key": str(tls.key_file)}
    merged: dict[str, dict[str, str | int | float | bool]] = {
        "server": {
            "hostname": "mta.test",
            "data_dir": str(directory),
            "node_name": node_name,
            "shutdown_timeout": "5s",
        },
        "database": {"url": db_url},
        "api": {"listen": f"127.0.0.1:{api_port}" if api_port is not None else ""},
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "delivery": {"relayhost": relayhost},
        "log": {"delivery_log": ""},
    }
    for name, keys in (tables or {}).items():
        merged.setdefault(name, {}).update(keys)
    every = [listener, *listeners] if listener else list(listeners)
    lines = [] if every else ["listener = []"]
    for name, keys in merged.items():
        lines.append(f"[{name}]")
        lines.extend(f"{_key(key)} = {_toml(value)}" for key, value in keys.items())
    for kind, entries in (("listener", every), ("outbox", outboxes)):
        for one in entries:
            lines.append(f"[[{kind}]]")
            lines.extend(f"{_key(key)} = {_toml(value)}" for key, value in one.items())
    return write_config(directory, "\n".join(lines) + "\n")


async def pigeon_with(config: Path, *args: str, stdin: str | None = None) -> str:
    """`pigeon-mta ARGS --config CONFIG`; its output, once it succeeded."""
    result = await asyncio.to_thread(run_pigeon, *args, "--config", str(config), input=stdin)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


@asynccontextmanager
async def relay_serve(
    tmp_path: Path,
    db_url: str,
    *,
    node_name: str,
    domain: str = "acme.example",
    user: tuple[str, str] | None = None,
    submission: bool = True,
    tls: ServerTLS | None = None,
    api: bool = False,
    processes: int = 1,
    tables: Mapping[str, Table] | None = None,
    ready: Sequence[str] = ("ready",),
    sink: SinkState | None = None,
    setup: Sequence[Sequence[str]] = (),
    listeners: Sequence[Table] = (),
    outboxes: Sequence[Table] = (),
) -> AsyncIterator[Relay]:
    """Org `acme` with `domain` (and `user`, (name, password), when given; then the `setup`
    commands, their output in `prepared`), a sink, and serve with
    `processes` workers up for the block, once each `ready` line has appeared in its log for each
    worker ("worker N " in front); then serve is stopped (SIGTERM, its exit code in `exit_code`)
    and the sink with it."""
    submission_port = free_port() if submission else None
    api_port = free_port() if api else None
    state = sink or SinkState()
    server = await start_sink(state, "127.0.0.2", 0)
    relay: Relay | None = None
    try:
        config = relay_config(
            tmp_path,
            db_url,
            node_name=node_name,
            relayhost=f"127.0.0.2:{server.sockets[0].getsockname()[1]}",
            submission_port=submission_port,
            tls=tls,
            api_port=api_port,
            listeners=listeners,
            outboxes=outboxes,
            tables={
                **(tables or {}),
                "server": {"processes": processes, **(tables or {}).get("server", {})},
            },
        )
        await pigeon_with(config, "org", "add", "acme")
        await pigeon_with(config, "domain", "add", "acme", domain)
        if user is not None:
            name, password = user
            await pigeon_with(
                config, "user", "add", "acme", name, "--password-stdin", stdin=password + "\n"
            )
        prepared = [await pigeon_with(config, *command) for command in setup]
        serve = ServeProcess("--config", str(config))
        relay = Relay(config, serve, state, submission_port, api_port, prepared)
        for worker in range(processes):
            for line in ready:
                await asyncio.to_thread(relay.serve.wait_for, f"worker {worker} {line}")
        yield relay
    finally:
        if relay is not None:
            relay.exit_code = await asyncio.to_thread(relay.serve.stop)
        await stop_servers([server])
