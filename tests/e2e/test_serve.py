"""`pigeon-mta serve` as a newcomer and an operator run it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config


@pytest.mark.slow
def test_serve_with_no_config_and_no_database_url_uses_the_embedded_database(
    tmp_path: Path,
) -> None:
    """The quick start, in a data directory of the test's own ($PIGEON_DATA_DIR): the tests never
    write the machine's default one, which a newcomer's `serve` then finds."""
    serve = ServeProcess(
        "--processes",
        "1",
        env={"PIGEON_DATA_DIR": str(tmp_path)},
        drop_env=("PIGEON_CONFIG", "PIGEON_DATABASE_URL"),
    )
    try:
        line = serve.wait_for("database: embedded PostgreSQL in", timeout=120)
        assert str(tmp_path) in line, line
        serve.wait_for("worker 0 ready", timeout=60)
    finally:
        code = serve.stop(signal.SIGTERM)
    assert code == 0, serve.output
    assert "stopped" in serve.output
    assert "Traceback" not in serve.output


def test_serve_on_a_configured_database_stops_on_sigint(tmp_path: Path, db_url: str) -> None:
    config = write_config(
        tmp_path,
        f'[server]\nnode_name = "test-node"\ndata_dir = "{tmp_path}"\n[database]\nurl = "{db_url}"\n'
        f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n',
    )
    serve = ServeProcess("--config", str(config), "--processes", "1")
    try:
        serve.wait_for("worker 0 ready")
    finally:
        code = serve.stop(signal.SIGINT)
    assert code == 0, serve.output
    assert "node test-node serving" in serve.output


def test_serve_exits_non_zero_when_a_listener_cannot_bind(tmp_path: Path, db_url: str) -> None:
    """The port is taken by another program: serve says so and exits 1 (systemd restarts it)."""
    import socket

    from tests.conftest import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(
            tmp_path,
            f'[server]\nnode_name = "bind-test"\ndata_dir = "{tmp_path}"\n'
            f'[database]\nurl = "{db_url}"\n'
            f'[[listener]]\nname = "relay"\naddress = "127.0.0.1:{port}"\n'
            f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n',
        )
        serve = ServeProcess("--config", str(config), "--processes", "1")
        try:
            code = serve.proc.wait(60)
        finally:
            serve.kill()
    assert code == 1, serve.output
    assert "cannot bind" in serve.output
