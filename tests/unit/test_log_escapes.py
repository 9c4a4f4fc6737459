"""The process's text log shows control characters from clients as visible escapes."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

# What a client may send as its AUTH user name, HELO name or address: a carriage return that
# starts a forged line on a terminal, an escape sequence that clears it, a NUL, a C1 CSI, DEL
# and a Unicode line separator.
HOSTILE = (
    "mallory\r2025-01-01T00:00:00.000Z INFO pigeon_mta.auth[1]: AUTH ok\x1b[2J\x00\x9b\x7f\u2028!"
)


def log_text(message: str, *args: str) -> str:
    code = (
        "import logging\n"
        "from pigeon_mta.logs import setup_logging\n"
        "setup_logging('info', 'text')\n"
        f"logging.getLogger('pigeon_mta.submission').warning({message!r}, *{args!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr.decode("utf-8")


def test_a_hostile_auth_user_name_is_escaped_on_its_one_line() -> None:
    text = log_text("AUTH failed: user=%s client=[%s]", HOSTILE, "192.0.2.1")
    assert text.endswith("\n") and text.count("\n") == 1
    line = text[:-1]
    assert line.isprintable(), repr(line)
    assert (
        "user=mallory\\r2025-01-01T00:00:00.000Z INFO pigeon_mta.auth[1]: AUTH ok"
        "\\x1b[2J\\x00\\x9b\\x7f\\u2028! client=[192.0.2.1]"
    ) in line


def test_tabs_are_escaped_and_other_text_is_kept() -> None:
    line = log_text("HELO %s from %s", "a\tb", "ünïcode.example").rstrip("\n")
    assert line.endswith("HELO a\\tb from ünïcode.example")
