"""The code stays linted, formatted and type-checked (mypy strict on the package)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def tool(name: str) -> list[str]:
    if (
        shutil.which(name) is None
        and subprocess.run(
            [sys.executable, "-m", name, "--version"], capture_output=True
        ).returncode
        != 0
    ):
        pytest.fail(f"{name} is not installed; install the test extra: pip install -e '.[test]'")
    return [sys.executable, "-m", name]


def test_ruff_lint() -> None:
    result = run(*tool("ruff"), "check", "pigeon_mta", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run(*tool("ruff"), "format", "--check", "pigeon_mta", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    result = run(*tool("mypy"))
    assert result.returncode == 0, result.stdout + result.stderr
