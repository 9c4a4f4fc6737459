"""What the end-to-end tests share: the CLI against a test database, README's code blocks, and
whether the queue has settled."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from tests.conftest import REPO, run_pigeon

README = (REPO / "README.md").read_text()


def pigeon_ok(db_url: str, *args: str) -> str:
    """`pigeon-mta ARGS` on the test database; its output, once it succeeded."""
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def pigeon_json(db_url: str, *args: str) -> Any:
    """`pigeon-mta ARGS --json` on the test database; what it printed, once it succeeded."""
    return json.loads(pigeon_ok(db_url, *args, "--json"))


def readme_block(language: str, marker: str) -> str:
    """README's one code block of `language` ("" for a plain one) that contains `marker`."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in README.splitlines():
        if current is None and line.startswith("```"):
            current = []
            blocks.append((line[3:].strip(), current))
        elif current is not None and line == "```":
            current = None
        elif current is not None:
            current.append(line)
    found = ["\n".join(body) + "\n" for lang, body in blocks if lang == language]
    found = [block for block in found if marker in block]
    assert len(found) == 1, f"README has {len(found)} ```{language} blocks with {marker!r}"
    return found[0]


async def settled(pool: asyncpg.Pool) -> bool:
    """Whether no recipient is queued or being delivered."""
    live = await pool.fetchval(
        "SELECT count(*) FROM recipient WHERE status IN ('queued', 'delivering')"
    )
    return bool(live == 0)
