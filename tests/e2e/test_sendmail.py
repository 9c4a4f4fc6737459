"""The sendmail door as cron, PHP's mail() and scripts call it, with serve delivering to a sink:
`sendmail -t -i` (PHP's sendmail_path), recipients as arguments with a line of one dot ending
the message (cron), `pigeon-mta sendmail`; the mail is DKIM-signed and Bcc: never leaves. Bad
calls exit with sysexits(3) codes and queue nothing.

    echo ... | .venv/bin/sendmail -t -i ──intake──► PostgreSQL ◄── serve ──SMTP──► sink 127.0.0.2
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import asyncpg

from tests.conftest import REPO, free_port
from tests.e2e.relay_serve import Relay, relay_serve
from tests.peers.dkim_verify import dkim_zone, dkimpy_verify

SENDMAIL = REPO / ".venv" / "bin" / "sendmail"
PIGEON = REPO / ".venv" / "bin" / "pigeon-mta"


def run(
    command: list[str], config: Path, stdin: bytes, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*command, "-C", str(config)],
        input=stdin,
        capture_output=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


async def arrived(relay: Relay, subject: bytes, timeout: float = 30) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in relay.sink.messages:
            if b"Subject: " + subject + b"\r\n" in m.data:
                return m.data
        await asyncio.sleep(0.1)
    raise AssertionError(f"no message {subject!r} within {timeout}s")


async def test_sendmail_calls_of_php_and_cron_arrive_signed(tmp_path: Path, db_url: str) -> None:
    async with relay_serve(
        tmp_path,
        db_url,
        node_name="e2e-sendmail",
        submission=False,
        tables={
            "relay": {"trusted_org": "acme"},
            "delivery": {"poll_interval": "250ms"},
        },
        setup=[("dkim", "keygen", "acme.example", "--json")],
    ) as relay:
        # PHP's mail(): sendmail_path = "sendmail -t -i", the headers PHP writes.
        php = (
            b"To: ann@dest.test\nSubject: php\nCc: bob@dest.test\nBcc: secret@dest.test\n"
            b"From: Shop <shop@acme.example>\nX-PHP-Originating-Script: 0:index.php\n\n"
            b"line one\n.\nline after a lone dot\n"
        )
        done = await asyncio.to_thread(run, [str(SENDMAIL), "-t", "-i"], relay.config, php)
        assert done.returncode == 0, done.stderr
        data = await arrived(relay, b"php")
        [message] = [m for m in relay.sink.messages if m.data == data]
        assert sorted(message.rcpt_tos) == ["ann@dest.test", "bob@dest.test", "secret@dest.test"]
        assert b"Bcc:" not in data and b"secret@" not in data
        assert b"line after a lone dot" in data  # -i: the dot did not end it
        # The body as written, after one blank line.
        assert b"\r\n\r\nline one\r\n" in data and b"\r\n\r\n\r\n" not in data
        assert b"X-Pigeon-Submitted: by mta.test (pigeon-mta) over sendmail from local user" in data
        record = json.loads(relay.prepared[0])
        with dkim_zone({record["name"].rstrip("."): record["value"]}) as zone:
            assert dkimpy_verify(data, zone) == [True]

        # cron: recipients as arguments, no From:, -f for the envelope sender, and a line of one
        # dot ends the message (no -i).
        cron = b"Subject: cron\n\nbackup done\n.\nnot part of it\n"
        command = [str(PIGEON), "sendmail", "-f", "cron@acme.example", "-F", "Cron Daemon"]
        done = await asyncio.to_thread(run, [*command, "ops@dest.test"], relay.config, cron)
        assert done.returncode == 0, done.stderr
        data = await arrived(relay, b"cron")
        assert b"From: Cron Daemon <cron@acme.example>\r\n" in data
        assert b"backup done" in data and b"not part of it" not in data
        [message] = [m for m in relay.sink.messages if m.data == data]
        assert (message.mail_from, message.rcpt_tos) == ("cron@acme.example", ["ops@dest.test"])

        # Debian cron, as it calls it: a bare user name, qualified with server.hostname; a
        # LOGNAME with a line break does not reach the header.
        cron = b"Subject: debian\n\nout\n"
        command = [str(SENDMAIL), "-FCronDaemon", "-i", "-B8BITMIME", "-oem", "root"]
        done = await asyncio.to_thread(
            run, command, relay.config, cron, {"LOGNAME": "ev\nil", "USER": "ev\nil"}
        )
        assert done.returncode == 0, done.stderr
        data = await arrived(relay, b"debian")
        [message] = [m for m in relay.sink.messages if m.data == data]
        assert message.rcpt_tos == ["root@mta.test"]
        assert message.mail_from == "ev?il@mta.test" and b"local user ev?il" in data

        # Bad calls: the code says what, nothing is queued.
        pool = await asyncpg.connect(db_url)
        try:
            before = await pool.fetchval("SELECT count(*) FROM message")
            for command, stdin, code in [
                ([str(SENDMAIL)], b"Subject: x\n\nno one\n", 64),  # EX_USAGE: no recipients
                ([str(SENDMAIL), "not an address"], b"Subject: x\n\n", 67),  # EX_NOUSER
                ([str(SENDMAIL), "-q1h", "a@dest.test"], b"", 64),  # an option it does not run
                ([str(SENDMAIL), "a@dest.test"], b"X-Pigeon-Colour: red\n\nx\n", 65),  # EX_DATAERR
            ]:
                done = await asyncio.to_thread(run, command, relay.config, stdin)
                assert done.returncode == code, (command, done.stderr)
                assert done.stderr.startswith(b"sendmail: "), done.stderr
            assert await pool.fetchval("SELECT count(*) FROM message") == before
        finally:
            await pool.close()
    assert relay.exit_code == 0, relay.serve.output


def test_a_database_that_cannot_be_reached_is_a_temporary_failure(tmp_path: Path) -> None:
    config = tmp_path / "pigeon.toml"
    port = free_port()
    config.write_text(
        f'[database]\nurl = "postgresql://postgres@127.0.0.1:{port}/none"\nconnect_timeout = "2s"\n'
    )
    done = run([str(SENDMAIL), "a@dest.test"], config, b"Subject: x\n\nx\n")
    assert done.returncode == 75, done.stderr  # EX_TEMPFAIL: cron and PHP try again later
    assert b"the queue cannot be reached now" in done.stderr
