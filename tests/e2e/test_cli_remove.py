"""The real command: `domain remove` (and the domain's DKIM keys) and `org remove [--force]`."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from tests.conftest import run_pigeon
from tests.integration.queue_helpers import bulk_queue


def pigeon(db_url: str, *args: str) -> tuple[int, Any, str]:
    """(exit status, the JSON printed or None, stderr)."""
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    out = json.loads(result.stdout) if result.returncode == 0 and "--json" in args else None
    return result.returncode, out, result.stderr


async def test_domain_remove_deletes_its_dkim_keys_and_no_other(
    db_url: str, pool: asyncpg.Pool
) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    for domain in ("acme.example", "keep.example"):
        assert pigeon(db_url, "domain", "add", "acme", domain)[0] == 0
        assert pigeon(db_url, "dkim", "keygen", domain, "--selector", "s1")[0] == 0
    assert pigeon(db_url, "dkim", "keygen", "acme.example", "--algorithm", "ed25519")[0] == 0

    code, out, err = pigeon(db_url, "domain", "remove", "ACME.example", "--json")
    assert code == 0, err
    assert out["domain"] == "acme.example" and out["org"] == "acme"
    assert len(out["dkim_keys_deleted"]) == 2 and "s1" in out["dkim_keys_deleted"]
    rows = await pool.fetch(
        "SELECT d.domain, k.selector FROM dkim_key k JOIN sender_domain d ON d.id = k.domain_id"
    )
    assert [(r["domain"], r["selector"]) for r in rows] == [("keep.example", "s1")]

    code, _out, err = pigeon(db_url, "domain", "remove", "acme.example")
    assert code == 1 and "no org has added the domain 'acme.example'" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # The domain can be added again, to any org, and gets new keys.
    assert pigeon(db_url, "domain", "add", "acme", "acme.example")[0] == 0


async def test_org_remove_is_refused_while_mail_waits_unless_forced(
    db_url: str, pool: asyncpg.Pool
) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    assert pigeon(db_url, "org", "add", "other")[0] == 0
    assert pigeon(db_url, "domain", "add", "acme", "acme.example")[0] == 0
    assert pigeon(db_url, "dkim", "keygen", "acme.example", "--selector", "s1")[0] == 0
    assert pigeon(db_url, "user", "add", "acme", "app")[0] == 0
    assert pigeon(db_url, "suppress", "add", "acme", "gone@example.net")[0] == 0
    acme = await pool.fetchval("SELECT id FROM org WHERE name = 'acme'")
    other = await pool.fetchval("SELECT id FROM org WHERE name = 'other'")
    await bulk_queue(pool, acme, messages=3, domain="example.net")
    await bulk_queue(pool, acme, messages=2, domain="example.net", status="delivered")
    await bulk_queue(pool, other, messages=4, domain="example.net")
    await pool.execute(
        """INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt, started_at, outcome)
           SELECT gen_random_uuid(), id, message_id, org_id, 1, now(), 'delivered'
           FROM recipient WHERE status = 'delivered'"""
    )

    code, _out, err = pigeon(db_url, "org", "remove", "acme")
    assert code == 1 and "org 'acme' has 3 recipient(s) queued or being delivered" in err
    assert "--force" in err and len(err.strip().splitlines()) == 1
    assert await pool.fetchval("SELECT count(*) FROM message WHERE org_id = $1", acme) == 5

    code, out, err = pigeon(db_url, "org", "remove", "acme", "--force", "--json")
    assert code == 0, err
    assert out["org"] == "acme" and out["undelivered_recipients"] == 3
    assert (out["users"], out["domains"], out["dkim_keys"], out["suppressions"]) == (1, 1, 1, 1)
    assert out["messages"] == 5
    # Nothing of acme is left; other's mail is untouched.
    for table in ("credential", "sender_domain", "dkim_key", "suppression", "message", "attempt"):
        assert await pool.fetchval(f"SELECT count(*) FROM {table} WHERE org_id = $1", acme) == 0
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE org_id = $1", acme) == 0
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE org_id = $1", other) == 4
    assert await pool.fetchval("SELECT array_agg(name) FROM org") == ["other"]

    for args, words in (
        (("org", "remove", "acme"), "there is no org 'acme'"),
        (("org", "remove", "internal"), "is relay.trusted_org in the config"),
    ):
        code, _out, err = pigeon(db_url, *args)
        assert code == 1 and words in err, err
