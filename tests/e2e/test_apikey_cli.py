"""The real command: `apikey add/list/revoke`, as an operator runs them."""

from __future__ import annotations

import hashlib
import json
import uuid

import asyncpg

from pigeon_mta.store.apikeys import find_active_key
from tests.conftest import run_pigeon


def pigeon(db_url: str, *args: str) -> tuple[int, str, str]:
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    return result.returncode, result.stdout, result.stderr


async def test_a_key_is_shown_once_stored_as_a_hash_listed_and_revoked(
    db_url: str, pool: asyncpg.Pool
) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    assert pigeon(db_url, "org", "add", "other")[0] == 0

    code, out, err = pigeon(db_url, "apikey", "add", "acme", "--name", "shop", "--json")
    assert code == 0, err
    added = json.loads(out)
    assert set(added) == {"id", "key"}
    key = added["key"]
    assert key.startswith("pgn_") and len(key) >= 40
    stored = await pool.fetchrow("SELECT key_hash, name, lane FROM api_key WHERE id = $1",
                                 uuid.UUID(added["id"]))  # fmt: skip
    assert stored is not None
    assert bytes(stored["key_hash"]) == hashlib.sha256(key.encode()).digest()
    assert (stored["name"], stored["lane"]) == ("shop", None)
    found = await find_active_key(pool, key)
    assert found is not None and found.org == "acme"

    # Without --json: a table for people, and a warning that the key is not shown again.
    code, out, err = pigeon(db_url, "apikey", "add", "other", "--lane", "bulk")
    assert code == 0, err
    assert "the key is shown only this once" in err
    other_key = next(line.split()[1] for line in out.splitlines() if line.startswith("key "))
    assert other_key.startswith("pgn_")
    assert "bulk" in out

    code, out, _ = pigeon(db_url, "apikey", "list", "--json")
    listed = json.loads(out)
    assert [(k["org"], k["name"], k["lane"], k["revoked"]) for k in listed] == [
        ("acme", "shop", None, False),
        ("other", "", "bulk", False),
    ]
    assert all("key" not in k and "key_hash" not in k for k in listed)
    code, out, _ = pigeon(db_url, "apikey", "list", "other")
    header, *rows = out.strip().splitlines()
    assert header.split()[:3] == ["ID", "ORG", "NAME"] and len(rows) == 1 and "other" in rows[0]

    code, out, err = pigeon(db_url, "apikey", "revoke", added["id"], "--json")
    assert code == 0, err
    assert json.loads(out)["revoked_at"]
    assert await find_active_key(pool, key) is None
    code, out, _ = pigeon(db_url, "apikey", "list", "acme", "--json")
    assert json.loads(out)[0]["revoked"] is True


async def test_mistakes_are_one_sentence_and_nonzero(db_url: str) -> None:
    pigeon(db_url, "org", "add", "acme")
    for args, expected in (
        (("apikey", "add", "nope"), "there is no org 'nope'"),
        (("apikey", "add", "acme", "--lane", "fast"), "there is no lane 'fast' in the settings"),
        (("apikey", "list", "nope"), "there is no org 'nope'"),
        (("apikey", "revoke", "12"), "'12' is not a key id"),
        (("apikey", "revoke", str(uuid.uuid4())), "there is no API key"),
        (("apikey", "add", "acme", "--name", "a\nb"), "--name must be at most"),
    ):
        code, out, err = pigeon(db_url, *args)
        assert code == 1, (args, out, err)
        assert expected in err, (args, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
