"""The real command: `org set`, `domain add/list`, `user add/list/disable`, as an operator runs them."""

from __future__ import annotations

import json
import os
import subprocess

import asyncpg

from pigeon_mta.store.credentials import verify_password
from tests.conftest import REPO, pigeon_command, run_pigeon


def pigeon(db_url: str, *args: str, input: str | None = None) -> tuple[int, str, str]:
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url}, input=input)
    return result.returncode, result.stdout, result.stderr


async def test_domains_and_users(db_url: str, pool: asyncpg.Pool) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    code, out, err = pigeon(db_url, "domain", "add", "acme", "Mail.ACME.example", "--json")
    assert code == 0, err
    assert json.loads(out)["domain"] == "mail.acme.example"

    # A generated password is printed once; only its hash is stored.
    code, out, err = pigeon(db_url, "user", "add", "acme", "app1", "--json")
    assert code == 0, err
    password = json.loads(out)["password"]
    assert len(password) >= 24
    stored = await pool.fetchval("SELECT password_hash FROM credential WHERE username = 'app1'")
    assert password not in stored and verify_password(password, stored)

    code, out, err = pigeon(
        db_url, "user", "add", "acme", "app2", "--password-stdin", input="pw two is long\n"
    )
    assert code == 0, err
    assert "pw two" not in out
    stored = await pool.fetchval("SELECT password_hash FROM credential WHERE username = 'app2'")
    assert verify_password("pw two is long", stored)

    code, out, _ = pigeon(db_url, "user", "list")
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert header.split()[:3] == ["USERNAME", "ORG", "DISABLED"]
    assert [r.split()[:3] for r in rows] == [["app1", "acme", "no"], ["app2", "acme", "no"]]

    code, out, _ = pigeon(db_url, "user", "disable", "app1")
    assert code == 0
    code, out, _ = pigeon(db_url, "user", "list", "--json")
    assert {u["username"]: u["disabled"] for u in json.loads(out)} == {"app1": True, "app2": False}

    code, out, _ = pigeon(db_url, "domain", "list")
    assert "mail.acme.example" in out and "acme" in out


async def test_mistakes_are_one_sentence_and_nonzero(db_url: str, pool: asyncpg.Pool) -> None:
    pigeon(db_url, "org", "add", "acme")
    pigeon(db_url, "org", "add", "other")
    assert pigeon(db_url, "domain", "add", "acme", "acme.example")[0] == 0
    pigeon(db_url, "user", "add", "acme", "app", "--password-stdin", input="twelve chars\n")
    cases = [
        (("domain", "add", "nosuch", "x.example"), "there is no org 'nosuch'"),
        (("domain", "add", "other", "ACME.example"), "already added to org 'acme'"),
        (("domain", "add", "acme", "not a domain"), "is not a domain name"),
        (("user", "add", "nosuch", "bob"), "there is no org 'nosuch'"),
        (("user", "add", "acme", "app"), "user 'app' already exists"),
        (("user", "add", "acme", "has space"), "no spaces"),
        (("user", "disable", "ghost"), "there is no user 'ghost'"),
        (("org", "set", "ghost", "--rate", "5"), "there is no org 'ghost'"),
        (("org", "set", "acme", "--rate", "fast"), "is not a number of messages per second"),
        (("org", "set", "acme", "--rate", "-1"), "must be 0 (no limit) or a positive number"),
        (("org", "set", "acme", "--rate", "nan"), "must be 0 (no limit) or a positive number"),
    ]
    for args, expected in cases:
        code, _out, err = pigeon(db_url, *args)
        assert code == 1, args
        assert expected in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _out, err = pigeon(db_url, "user", "add", "acme", "x2", "--password-stdin", input="")
    assert code == 1 and "no password on standard input" in err


def pigeon_bytes(db_url: str, *args: str | bytes, input: bytes = b"") -> tuple[int, str]:
    """The command with arguments or standard input that are not UTF-8; (exit status, stderr)."""
    env = {**os.environ, "PIGEON_DATABASE_URL": db_url, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [*pigeon_command(), *args], cwd=REPO, env=env, input=input, capture_output=True, timeout=60
    )
    return result.returncode, result.stderr.decode("utf-8", "replace")


def assert_one_sentence(code: int, err: str, expected: str) -> None:
    assert code == 1, err
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


async def test_bad_names_and_passwords_are_refused_in_one_sentence(
    db_url: str, pool: asyncpg.Pool
) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    assert pigeon(db_url, "user", "add", "acme", "alice")[0] == 0
    for args, expected in [
        (("org", "add", ""), "an org name must have 1 to"),
        (("org", "add", "evil\nacme"), "contains control characters, line breaks"),
        (("org", "add", "bell\x07"), "contains control characters"),
        (("org", "add", " acme"), "white space at its ends"),
        # Case only, and a look-alike (Cyrillic U+0430), are the same name to a reader.
        (("user", "add", "acme", "ALICE"), "'ALICE' differs from it only by case"),
        (("user", "add", "acme", "\u0430lice"), "may contain only ASCII letters"),
        (("user", "add", "acme", "\uff41lice"), "may contain only ASCII letters"),
    ]:
        assert_one_sentence(*pigeon(db_url, *args)[::2], expected)
    code, _out, err = pigeon(
        db_url, "user", "add", "acme", "bob", "--password-stdin", input="short\n"
    )
    assert_one_sentence(code, err, "has 5 characters; it needs at least 12")
    assert_one_sentence(
        *pigeon_bytes(
            db_url, "user", "add", "acme", "bob", "--password-stdin", input=b"caf\xe9 au lait ok\n"
        ),
        "the password on standard input is not valid UTF-8",
    )
    assert_one_sentence(*pigeon_bytes(db_url, "log", b"caf\xe9@example.net"), "is not valid UTF-8")
    assert await pool.fetchval("SELECT array_agg(name) FROM org") == ["acme"]
    assert await pool.fetchval("SELECT array_agg(username) FROM credential") == ["alice"]
    code, out, _err = pigeon(db_url, "org", "list")
    assert code == 0 and len(out.strip().splitlines()) == 2  # the header and acme


async def test_passwd_enable_and_delete_a_user(db_url: str, pool: asyncpg.Pool) -> None:
    assert pigeon(db_url, "org", "add", "acme")[0] == 0
    assert pigeon(db_url, "user", "add", "acme", "app")[0] == 0
    old_hash = await pool.fetchval("SELECT password_hash FROM credential")

    code, out, err = pigeon(db_url, "user", "passwd", "app", "--json")
    assert code == 0, err
    generated = json.loads(out)
    assert generated["username"] == "app" and len(generated["password"]) >= 24
    stored = await pool.fetchval("SELECT password_hash FROM credential")
    assert stored != old_hash and verify_password(generated["password"], stored)
    code, out, err = pigeon(
        db_url, "user", "passwd", "app", "--password-stdin", input="a new secret here\n"
    )
    assert code == 0 and "a new secret" not in out, err
    assert verify_password(
        "a new secret here", await pool.fetchval("SELECT password_hash FROM credential")
    )

    assert pigeon(db_url, "user", "disable", "app")[0] == 0
    code, out, err = pigeon(db_url, "user", "enable", "app", "--json")
    assert code == 0, err
    assert json.loads(out)["disabled"] is False
    assert (
        await pool.fetchval("SELECT disabled OR disabled_at IS NOT NULL FROM credential") is False
    )

    # A user who sent mail can be deleted: the message keeps its auth_user for the log.
    org_id = await pool.fetchval("SELECT id FROM org")
    user_id = await pool.fetchval("SELECT id FROM credential")
    await pool.execute(
        """INSERT INTO message (id, org_id, sender, size, body, listener, credential_id, auth_user)
           VALUES (gen_random_uuid(), $1, 'app@acme.example', 1, 'x', 'submission', $2, 'app')""",
        org_id,
        user_id,
    )
    code, out, err = pigeon(db_url, "user", "delete", "app", "--json")
    assert code == 0, err
    assert json.loads(out) == {"username": "app", "org": "acme", "deleted": True}
    assert await pool.fetchval("SELECT count(*) FROM credential") == 0
    assert await pool.fetchval("SELECT auth_user FROM message") == "app"
    for action in ("passwd", "enable", "delete"):
        assert_one_sentence(*pigeon(db_url, "user", action, "app")[::2], "there is no user 'app'")


async def test_an_orgs_rate_is_set_and_listed(db_url: str, pool: asyncpg.Pool) -> None:
    pigeon(db_url, "org", "add", "acme")
    code, out, err = pigeon(db_url, "org", "set", "acme", "--rate", "12.5", "--json")
    assert code == 0, err
    assert json.loads(out)["rate"] == 12.5
    code, out, _ = pigeon(db_url, "org", "list", "--json")
    assert [(o["name"], o["rate"]) for o in json.loads(out)] == [("acme", 12.5)]
    assert pigeon(db_url, "org", "set", "acme", "--rate", "0")[0] == 0
    assert await pool.fetchval("SELECT rate FROM org WHERE name = 'acme'") == 0
