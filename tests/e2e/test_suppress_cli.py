"""`pigeon-mta suppress add|remove|list`: the real command against a real database."""

from __future__ import annotations

import uuid

import asyncpg

from tests.conftest import run_pigeon
from tests.e2e.shared import pigeon_json as pigeon
from tests.integration.queue_helpers import suppressed_at_claim


def failing(db_url: str, *args: str) -> str:
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    return result.stderr


async def test_add_list_expire_and_remove(
    db_url: str, pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    added = pigeon(
        db_url, "suppress", "add", "acme", "Bob@Example.net", "carol@example.net",
        "--reason", "asked to stop", "--expires", "30d",
    )  # fmt: skip
    assert [(e["address"], e["source"], e["reason"]) for e in added] == [
        ("bob@example.net", "manual", "asked to stop"),
        ("carol@example.net", "manual", "asked to stop"),
    ]
    assert all(e["expires_at"] for e in added)
    pigeon(db_url, "suppress", "add", "acme", "old@example.net", "--expires", "2020-01-01")

    listed = pigeon(db_url, "suppress", "list", "acme")
    assert sorted(e["address"] for e in listed) == ["bob@example.net", "carol@example.net"]
    with_expired = pigeon(db_url, "suppress", "list", "acme", "--expired")
    assert len(with_expired) == 3
    # The engine's claim sees what the command wrote, and ignores the expired entry.
    assert await suppressed_at_claim(pool, org_id, ["BOB@example.net", "old@example.net"]) == {
        "BOB@example.net"
    }

    removed = pigeon(db_url, "suppress", "remove", "acme", "bob@example.net")
    assert removed == [{"address": "bob@example.net", "org": "acme"}]
    assert [e["address"] for e in pigeon(db_url, "suppress", "list")] == ["carol@example.net"]

    table = run_pigeon("suppress", "list", "acme", env={"PIGEON_DATABASE_URL": db_url})
    assert table.returncode == 0 and "carol@example.net" in table.stdout
    assert "ADDRESS" in table.stdout and "manual" in table.stdout


async def test_mistakes_are_one_sentence_errors(db_url: str, org_id: uuid.UUID) -> None:
    assert "not on the suppression list" in failing(
        db_url, "suppress", "remove", "acme", "nobody@example.net"
    )
    assert "no org named 'nope'" in failing(db_url, "suppress", "add", "nope", "a@example.net")
    assert "not an email address" in failing(db_url, "suppress", "add", "acme", "no-at-sign")
    assert "--expires" in failing(
        db_url, "suppress", "add", "acme", "a@example.net", "--expires", "someday"
    )
