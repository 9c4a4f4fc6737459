"""README.md's two commands: the test command is the one CI runs, and both come first."""

from __future__ import annotations

import re

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


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
