"""What `pigeon-mta serve` says once at start, and the metrics that exist before any traffic.

pigeon-mta serve (supervisor + 2 worker processes) ── PostgreSQL
   ├─ listeners relay, submission on 127.0.0.1 (no certificate: self-signed)
   └─ /metrics on 127.0.0.1 ◄── HTTP client
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config
from tests.e2e.test_observability import Samples, eventually, samples, scrape, value

SECRET = "hunter2"


def start(tmp_path: Path, db_url: str, metrics_port: int) -> ServeProcess:
    # Trust authentication ignores the password; it is there to be hidden.
    config = write_config(
        tmp_path,
        f"""
[server]
hostname = "localhost"
node_name = "start-test"
data_dir = "{tmp_path}"
shutdown_timeout = "5s"
[database]
url = "{db_url}?password={SECRET}"
[[listener]]
name = "relay"
address = "127.0.0.1:{free_port()}"
mode = "relay"
[[listener]]
name = "submission"
address = "127.0.0.1:{free_port()}"
mode = "submission"
[delivery]
relayhost = "127.0.0.1:{free_port()}"
[delivery.routes]
"corp.example" = "127.0.0.1:{free_port()}"
[metrics]
listen = "127.0.0.1:{metrics_port}"
[log]
delivery_log = ""
""",
    )
    serve = ServeProcess("--config", str(config), "--processes", "2")
    serve.wait_for("worker 0 ready")
    serve.wait_for("worker 1 ready")
    return serve


@pytest.fixture
def stop_later() -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for serve in started:
        serve.kill()


def test_start_warnings_and_routing_are_said_once_and_the_password_never(
    tmp_path: Path, db_url: str, stop_later: list[ServeProcess]
) -> None:
    serve = start(tmp_path, db_url, free_port())
    stop_later.append(serve)
    assert serve.stop(signal.SIGTERM) == 0, serve.output
    lines = serve.output.splitlines()

    def once(text: str) -> str:
        found = [line for line in lines if text in line]
        assert len(found) == 1, f"{text!r} logged {len(found)} times:\n{serve.output}"
        return found[0]

    assert " WARNING " in once("'server.hostname' is localhost: ")
    assert " WARNING " in once("listeners relay, submission have no tls_cert/tls_key")
    assert not [line for line in lines if "has no tls_cert" in line]
    routing = once("delivery: static routes corp.example -> 127.0.0.1:")
    assert "everything else through relayhost 127.0.0.1:" in routing
    assert "password=***" in once("database: PostgreSQL at postgresql://")
    assert SECRET not in serve.output
    assert "Traceback" not in serve.output


def test_labelled_counters_exist_at_zero_before_any_traffic(
    tmp_path: Path, db_url: str, stop_later: list[ServeProcess]
) -> None:
    port = free_port()
    serve = start(tmp_path, db_url, port)
    stop_later.append(serve)

    def listeners_bound() -> Samples | None:
        got = samples(scrape(port))
        bound = [value(got, "pigeon_listeners_bound", listener=n) for n in ("relay", "submission")]
        return got if bound == [2, 2] else None

    got = eventually(listeners_bound, "both listeners bound in both workers")
    for listener in ("relay", "submission"):
        assert value(got, "pigeon_messages_accepted_total", listener=listener) == 0
        assert value(got, "pigeon_auth_failures_total", listener=listener) == 0
    for outcome in ("delivered", "deferred", "bounced", "expired", "suppressed"):
        assert value(got, "pigeon_deliveries_total", outcome=outcome) == 0
    for algorithm in ("rsa", "ed25519"):
        assert value(got, "pigeon_dkim_signatures_total", algorithm=algorithm) == 0
    for reason in ("no_key", "no_from_domain", "malformed"):
        assert value(got, "pigeon_dkim_unsigned_total", reason=reason) == 0
    assert serve.stop(signal.SIGTERM) == 0, serve.output
