"""The real `pigeon-mta serve --processes 2`: both processes share the ports and accept mail, AUTH
works with a user made by the CLI, and SIGHUP reloads the certificate in every process.

smtplib ──SMTP / STARTTLS+AUTH──► 127.0.0.1:port ──SO_REUSEPORT──► worker 0 | worker 1 ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import smtplib
import time
from pathlib import Path

import asyncpg
import trustme

from tests.conftest import free_port, run_pigeon
from tests.e2e.serve_process import ServeProcess, write_config
from tests.integration.submission_helpers import issue_cert, make_tls, message

PID = re.compile(r"\[(\d+)\]: ")


def pids_of(serve: ServeProcess, text: str) -> set[str]:
    return {m.group(1) for line in serve.lines if text in line for m in [PID.search(line)] if m}


def wait_for_pids(serve: ServeProcess, text: str, count: int, timeout: float = 60) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pids_of(serve, text)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{text!r} from {count} processes did not appear:\n{serve.output}")


async def test_serve_two_processes_accept_mail_and_reload_certificates(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    relay_port, submission_port = free_port(), free_port()
    config = write_config(
        tmp_path,
        f"""
[server]
hostname = "mta.test"
data_dir = "{tmp_path}"
node_name = "e2e"
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{relay_port}"
mode = "relay"
tls_cert = "{tls.cert_file}"
tls_key = "{tls.key_file}"
[[listener]]
name = "submission"
address = "127.0.0.1:{submission_port}"
mode = "submission"
tls_cert = "{tls.cert_file}"
tls_key = "{tls.key_file}"
[relay]
trusted_networks = ["127.0.0.1/32"]
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
enabled = false  # accept-only: this test is about the front door (and must not resolve example.net)
""",
    )
    for args, stdin in [
        (("org", "add", "acme"), None),
        (("domain", "add", "acme", "acme.example"), None),
        (("user", "add", "acme", "app", "--password-stdin"), "app password\n"),
    ]:
        result = await asyncio.to_thread(run_pigeon, *args, "--config", str(config), input=stdin)
        assert result.returncode == 0, result.stderr

    serve = ServeProcess("--config", str(config), "--processes", "2")
    try:
        await asyncio.to_thread(wait_for_pids, serve, "listener relay bound on", 2)
        await asyncio.to_thread(wait_for_pids, serve, "listener submission bound on", 2)
        assert f"listener relay bound on 127.0.0.1:{relay_port} (relay)" in serve.output

        def relay_until_both_processes_accepted() -> int:
            sent = 0
            while len(pids_of(serve, "queued ")) < 2 and sent < 300:
                with smtplib.SMTP("127.0.0.1", relay_port, timeout=30) as client:
                    client.sendmail(
                        "cron@host.internal", ["ops@example.net"], message("c@h", "o@e")
                    )
                sent += 1
            return sent

        sent = await asyncio.to_thread(relay_until_both_processes_accepted)
        assert len(pids_of(serve, "queued ")) == 2, serve.output

        def submit(context_tls: object) -> tuple[int, bytes]:
            with smtplib.SMTP("127.0.0.1", submission_port, timeout=30) as client:
                client.starttls(context=context_tls)  # type: ignore[arg-type]
                client.login("app", "app password")
                client.mail("app@acme.example")
                client.rcpt("bob@example.net")
                return client.data(message("app@acme.example", "bob@example.net"))

        code, reply = await asyncio.to_thread(submit, tls.client_context())
        assert code == 250 and b"queued as" in reply

        # Renew the certificate files, SIGHUP the supervisor: every worker reloads.
        renewed = issue_cert(trustme.CA(), tmp_path, "renewed")
        shutil.copy(renewed.cert_file, tls.cert_file)
        shutil.copy(renewed.key_file, tls.key_file)
        serve.proc.send_signal(signal.SIGHUP)
        await asyncio.to_thread(
            wait_for_pids, serve, "listener submission: TLS certificate reloaded", 2
        )
        for _ in range(8):  # new connections land on either process
            code, _ = await asyncio.to_thread(submit, renewed.client_context())
            assert code == 250
    finally:
        exit_code = await asyncio.to_thread(serve.stop, signal.SIGTERM)
    assert exit_code == 0, serve.output
    assert "Traceback" not in serve.output
    assert "WARNING mail.log" not in serve.output  # aiosmtpd kept quiet
    accepted = await pool.fetchval("SELECT count(*) FROM message")
    assert accepted == sent + 1 + 8
    assert await pool.fetchval("SELECT count(*) FROM message WHERE auth_user = 'app'") == 9


async def test_sighup_while_workers_start_reloads_instead_of_killing_them(
    tmp_path: Path, db_url: str
) -> None:
    """A SIGHUP that reaches a worker before it has set up its handler waits (the worker starts
    with SIGHUP blocked) instead of killing it with the default action: SIGHUPs sent from the
    moment `serve` starts never make the supervisor restart a worker."""
    config = write_config(
        tmp_path,
        f"""
[server]
hostname = "mta.test"
data_dir = "{tmp_path}"
node_name = "e2e-hup"
[database]
url = "{db_url}"
[[listener]]
name = "relay"
address = "127.0.0.1:{free_port()}"
mode = "relay"
[metrics]
listen = "127.0.0.1:{free_port()}"
[delivery]
enabled = false
""",
    )
    serve = ServeProcess("--config", str(config), "--processes", "2")
    try:
        deadline = time.monotonic() + 60
        while len(pids_of(serve, "listener relay bound")) < 2:
            assert time.monotonic() < deadline and serve.proc.poll() is None, serve.output
            if "started worker" in serve.output:
                serve.proc.send_signal(signal.SIGHUP)  # forwarded to the workers at once
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.5)  # a worker killed at the last moment would be noticed by now
        assert "exited with" not in serve.output, serve.output
        assert "received SIGHUP" in serve.output
    finally:
        exit_code = await asyncio.to_thread(serve.stop, signal.SIGTERM)
    assert exit_code == 0, serve.output
