"""`pigeon-mta serve` refuses to start while another process listens on a port its workers share.

holder (this test): a SO_REUSEPORT socket listening on 127.0.0.1:port or [::1]:port, as a
    worker of another serve does
pigeon-mta serve (2 processes), a [[listener]] or [api] listen on that address ── PostgreSQL
    -> exits 1 with one line naming the setting and the address; nothing else is started

raw SMTP client --QUIT--> serve: the server closes first, its side waits in TIME_WAIT
    -> serve stops -> serve starts again on the same config and binds
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pigeon_mta.config import HostPort
from tests.conftest import free_port
from tests.e2e.serve_process import ServeProcess, write_config
from tests.e2e.tcp_table import TIME_WAIT, tcp_sockets

REFUSED = "the address is in use by another process (another pigeon-mta serve?)"


def reuseport_listener(host: str) -> socket.socket:
    """A listening socket bound as every worker of a serve binds its ports."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def config(tmp_path: Path, db_url: str, *, listener: str | None, api: str) -> Path:
    listeners = (
        f'[[listener]]\nname = "relay"\naddress = "{listener}"\nmode = "relay"\n'
        if listener
        else "listener = []\n"
    )
    return write_config(
        tmp_path,
        f"""{listeners}
[server]
node_name = "ports-test"
data_dir = "{tmp_path}"
processes = 2
shutdown_timeout = "3s"
[database]
url = "{db_url}"
[metrics]
listen = "127.0.0.1:{free_port()}"
[api]
listen = "{api}"
[log]
delivery_log = ""
""",
    )


def refused_output(path: Path) -> str:
    """Run serve on `path`, which must exit 1 by itself; its output."""
    serve = ServeProcess("--config", str(path))
    try:
        code = serve.proc.wait(60)
    finally:
        serve.kill()
    serve.stop()  # joins the output reader
    assert code == 1, serve.output
    return serve.output


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_refuses_a_listener_address_another_process_listens_on(
    tmp_path: Path, db_url: str, host: str
) -> None:
    with reuseport_listener(host) as holder:
        address = HostPort(host, holder.getsockname()[1])
        output = refused_output(config(tmp_path, db_url, listener=str(address), api=""))
    # One line, and nothing before it: no database, no metrics listener, no worker.
    assert output.splitlines() == [
        f"pigeon-mta: listener 'relay' cannot bind {address}: {REFUSED}"
    ], output


def test_serve_refuses_an_api_listen_address_another_process_listens_on(
    tmp_path: Path, db_url: str
) -> None:
    with reuseport_listener("127.0.0.1") as holder:
        address = HostPort("127.0.0.1", holder.getsockname()[1])
        output = refused_output(config(tmp_path, db_url, listener=None, api=str(address)))
    assert output.splitlines() == [
        f"pigeon-mta: the HTTP API cannot bind 'api.listen' {address}: {REFUSED}"
    ], output


def time_wait_ports() -> set[int]:
    """Local ports of the TCP connections in TIME_WAIT."""
    return {s.local_port for s in tcp_sockets() if s.state == TIME_WAIT}


def quit_and_wait_for_the_server_to_close(port: int) -> None:
    """An SMTP session that ends with the server's close: its side waits in TIME_WAIT."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        reader = client.makefile("rb")
        assert reader.readline().startswith(b"220")
        client.sendall(b"QUIT\r\n")
        assert reader.readline().startswith(b"221")
        assert reader.read() == b""  # the server closed first


def test_a_restart_binds_while_the_last_runs_connections_wait_in_time_wait(
    tmp_path: Path, db_url: str
) -> None:
    port = free_port()
    path = config(tmp_path, db_url, listener=f"127.0.0.1:{port}", api="")
    first = ServeProcess("--config", str(path))
    try:
        first.wait_for("worker 1 ready")
        quit_and_wait_for_the_server_to_close(port)
    finally:
        assert first.stop() == 0, first.output
    assert port in time_wait_ports()
    again = ServeProcess("--config", str(path))
    try:
        again.wait_for("worker 0 ready")
        again.wait_for("worker 1 ready")
    finally:
        assert again.stop() == 0, again.output
    assert REFUSED not in again.output
