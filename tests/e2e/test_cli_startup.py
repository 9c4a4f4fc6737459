"""The command imports only what the chosen command needs (its start-up time is in bench/README.md).

Not a timed test: each case runs the real command in a fresh interpreter and asks which of the
heavy modules it loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# The service's modules and the DKIM command's: most of what the command cost to start.
HEAVY = (
    "pigeon_mta.supervisor",
    "pigeon_mta.app",
    "pigeon_mta.maintenance",
    "prometheus_client",
    "uvloop",
    "pigeon_mta.commands.dkim",
    "dkim",
)

_PROBE = f"""
import json, sys
from pigeon_mta import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
loaded = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps({{"exit": code, "loaded": loaded}}), file=sys.stderr)
"""


def loaded_by(*args: str, db_url: str | None = None) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if db_url:
        env["PIGEON_DATABASE_URL"] = db_url
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(result.stderr.strip().splitlines()[-1])
    return report["exit"], report["loaded"]


def test_version_and_help_load_no_command_module() -> None:
    assert loaded_by("--version") == (0, [])
    assert loaded_by("--help") == (0, [])


@pytest.mark.parametrize(
    "args",
    [("queue",), ("queue", "list"), ("log", "nobody@example.net"), ("org", "list")],
)
def test_admin_commands_load_neither_the_service_nor_dkim(
    db_url: str, args: tuple[str, ...]
) -> None:
    exit_code, loaded = loaded_by(*args, db_url=db_url)
    assert exit_code in (0, 1)  # `log` of an unknown address says so and exits 1
    assert loaded == []


def test_the_chosen_command_still_loads_what_it_needs() -> None:
    exit_code, loaded = loaded_by("dkim", "--help")
    assert exit_code == 0 and "pigeon_mta.commands.dkim" in loaded
