"""README's client examples (Python, Node.js with nodemailer, msmtp), taken from README.md itself,
run against the real `pigeon-mta serve` with its self-signed certificate, as the quick start has it.

Only README's placeholders are replaced: the port, the certificate path (the one serve logs) and the
password; the host stays `localhost`.

python / node / msmtp ──STARTTLS (self-signed cert, trusted)+AUTH──► pigeon submission
                                                                        │ PostgreSQL queue
                              aiosmtpd sink 127.0.0.2:port ◄──SMTP──────┘ ([delivery] relayhost)

README's webhook signature check runs on a ping that `pigeon-mta webhook test` sent to a real
aiohttp receiver.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_pigeon
from tests.e2e.relay_serve import relay_serve
from tests.e2e.shared import readme_block
from tests.peers.webhook_receiver import WebhookReceiver

NODE_MODULES = REPO / ".venv" / "peers" / "node" / "node_modules"
PASSWORD = "readme example password"

# The placeholders as README writes them.
README_PORT = "2587"
README_CA_FILE = "/var/lib/pigeon-mta/tls/selfsigned.pem"
README_PASSWORD = "PASSWORD"


def substitute(text: str, replacements: dict[str, str]) -> str:
    for placeholder, value in replacements.items():
        assert placeholder in text, f"the README example has no placeholder {placeholder!r}"
        text = text.replace(placeholder, value)
    return text


def run(command: list[str], cwd: Path, env: dict[str, str], stdin: bytes = b"") -> str:
    result = subprocess.run(
        command, cwd=cwd, env={**os.environ, **env}, input=stdin, capture_output=True, timeout=120
    )
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, f"{command[0]} failed:\n{output}"
    return output


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/test --setup-only")
    return path


async def test_readme_client_examples_send_through_the_quick_start(
    tmp_path: Path, db_url: str
) -> None:
    # The quick start's submission listener: no tls_cert, so the self-signed certificate.
    async with relay_serve(
        tmp_path, db_url, node_name="e2e-readme", domain="example.com", user=("app", PASSWORD)
    ) as relay:
        state, serve, port = relay.sink, relay.serve, str(relay.submission_port)
        line = await asyncio.to_thread(serve.wait_for, "uses the self-signed certificate")
        ca_file = re.search(r"uses the self-signed certificate (\S+)", line)
        assert ca_file, line

        # Python: the snippet as a script.
        python = substitute(
            readme_block("python", "smtplib"),
            {f", {README_PORT}\n": f", {port}\n", README_CA_FILE: ca_file.group(1)},
        )
        (tmp_path / "send.py").write_text(python)
        await asyncio.to_thread(
            run, [sys.executable, "send.py"], tmp_path, {"SMTP_PASSWORD": PASSWORD}
        )

        # Node.js: send.js next to the nodemailer scripts/test installed; the command line of
        # its first comment gives the environment.
        js = readme_block("js", "nodemailer")
        command_line = js.splitlines()[0]
        assert f"NODE_EXTRA_CA_CERTS={README_CA_FILE} " in command_line, command_line
        js = substitute(js, {f"port: {README_PORT},": f"port: {port},"})
        if not NODE_MODULES.exists():
            pytest.fail(f"nodemailer is missing ({NODE_MODULES}): run scripts/test --setup-only")
        (tmp_path / "node_modules").symlink_to(NODE_MODULES)
        (tmp_path / "send.js").write_text(js)
        node_output = await asyncio.to_thread(
            run,
            [tool("node"), "send.js"],
            tmp_path,
            {"NODE_EXTRA_CA_CERTS": ca_file.group(1), "SMTP_PASSWORD": PASSWORD},
        )
        assert "250 2.0.0 Ok: queued as " in node_output, node_output

        # msmtp: the configuration file as README gives it, and cron's message (From: root).
        msmtprc = substitute(
            readme_block("", "tls_starttls"),
            {
                f"port {README_PORT}\n": f"port {port}\n",
                README_CA_FILE: ca_file.group(1),
                f"password {README_PASSWORD}\n": f"password {PASSWORD}\n",
            },
        )
        (tmp_path / "msmtprc").write_text(msmtprc)
        (tmp_path / "msmtprc").chmod(0o600)  # msmtp refuses a password file others can read
        await asyncio.to_thread(
            run,
            [tool("msmtp"), "-C", str(tmp_path / "msmtprc"), "bob@example.net"],
            tmp_path,
            {},
            b"From: root@client.test (Cron Daemon)\nSubject: cron\n\nSent by msmtp.\n",
        )

        try:
            await state.wait_for(lambda: state.deliveries()["bob@example.net"] == 3, 60)
        except AssertionError:
            raise AssertionError(f"not delivered; serve:\n{serve.output}") from None
    assert relay.exit_code == 0, serve.output

    received = state.received_by("bob@example.net")
    assert [m.mail_from for m in received] == ["app@example.com"] * 3
    bodies = b"\n".join(m.data for m in received)
    assert b"Sent through pigeon-mta." in bodies  # Python
    assert b"\r\n\r\nHi" in bodies  # Node.js
    [cron] = [m for m in received if b"Sent by msmtp." in m.data]
    assert b"\r\nFrom: app@example.com" in cron.data and b"root@client.test" not in cron.data


async def test_readme_webhook_verification_accepts_a_real_ping_and_refuses_a_forgery(
    db_url: str,
) -> None:
    """README's `verify`, run as written (only its SECRET placeholder replaced), on the request
    that `pigeon-mta webhook test` sent to a real receiver."""
    env = {"PIGEON_DATABASE_URL": db_url}
    receiver = WebhookReceiver()
    await receiver.start()
    try:
        assert run_pigeon("org", "add", "acme", env=env).returncode == 0
        added = run_pigeon("webhook", "add", "acme", receiver.url, "--json", env=env)
        assert added.returncode == 0, added.stderr
        secret = json.loads(added.stdout)["secret"]
        result = await asyncio.to_thread(
            run_pigeon, "webhook", "test", json.loads(added.stdout)["id"], env=env
        )
        assert result.returncode == 0, result.stderr
    finally:
        await receiver.stop()
    [ping] = receiver.requests

    code = substitute(readme_block("python", "webhook-signature"), {'"whsec_..."': repr(secret)})
    namespace: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    verify = namespace["verify"]
    assert verify(ping.headers, ping.body) is True
    assert verify(ping.headers, ping.body.replace(b"ping", b"pong")) is False
    assert verify({**ping.headers, "webhook-id": "another"}, ping.body) is False
    stale = str(int(ping.headers["webhook-timestamp"]) - 3600)
    assert verify({**ping.headers, "webhook-timestamp": stale}, ping.body) is False
