"""README.md's two commands: the test command is the one CI runs, both come first, and the test
command sets up every tool the tests ask for."""

from __future__ import annotations

import os
import re

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()
TEST_SCRIPT = REPO / "scripts" / "test"


def readme_test_command() -> str:
    block = re.search(
        r"<!-- test-command -->\n```sh\n(.+?)\n```\n<!-- /test-command -->", README, re.S
    )
    assert block, "README.md has no test command between the test-command markers"
    return block.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = readme_test_command()
    lines = [line.strip() for line in CI.splitlines()]
    assert command in lines, f".ci/run does not run README's test command: {command}"
    assert CI.rstrip().endswith(command), (
        "README's test command must be the last thing .ci/run runs"
    )


def test_the_two_commands_come_first() -> None:
    first_blocks = re.findall(r"```sh\n(.+?)\n```", README, re.S)[:2]
    assert "pigeon-mta serve" in first_blocks[0] and "pip install ." in first_blocks[0]
    assert first_blocks[1].strip() == readme_test_command()


def test_the_test_command_is_the_setup_script_and_runs_pytest() -> None:
    """On a fresh machine the command alone must do: set up, then the whole suite."""
    assert readme_test_command() == "scripts/test"
    assert os.access(TEST_SCRIPT, os.X_OK)
    script = TEST_SCRIPT.read_text()
    assert "pip install -q -e '.[test]'" in script
    assert script.rstrip().endswith('exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"')


def test_every_debian_package_the_tests_ask_for_is_installed_by_the_test_command() -> None:
    """A test that misses a tool names its package ("apt-get install X"); the script installs it."""
    script = TEST_SCRIPT.read_text()
    declared = re.search(r"APT_PACKAGES=\((.*?)\)", script, re.S)
    assert declared, "scripts/test has no APT_PACKAGES list"
    installed = set(declared.group(1).split())
    asked: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        asked.update(re.findall(r"apt-get install ([a-z0-9][a-z0-9.+-]+)", path.read_text()))
    assert asked, "no test names a Debian package"
    assert asked <= installed, f"scripts/test does not install {sorted(asked - installed)}"
