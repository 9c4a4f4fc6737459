"""The real command: `domain add/list`, `user add/list/disable`, as an operator runs them."""

from __future__ import annotations

import json

import asyncpg

from pigeon_mta.store.credentials import verify_password
from tests.conftest import run_pigeon


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
        db_url, "user", "add", "acme", "app2", "--password-stdin", input="pw two\n"
    )
    assert code == 0, err and "pw two" not in out
    stored = await pool.fetchval("SELECT password_hash FROM credential WHERE username = 'app2'")
    assert verify_password("pw two", stored)

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
    pigeon(db_url, "user", "add", "acme", "app", "--password-stdin", input="x\n")
    cases = [
        (("domain", "add", "nosuch", "x.example"), "there is no org 'nosuch'"),
        (("domain", "add", "other", "ACME.example"), "already added to org 'acme'"),
        (("domain", "add", "acme", "not a domain"), "is not a domain name"),
        (("user", "add", "nosuch", "bob"), "there is no org 'nosuch'"),
        (("user", "add", "acme", "app"), "user 'app' already exists"),
        (("user", "add", "acme", "has space"), "cannot contain spaces"),
        (("user", "disable", "ghost"), "there is no user 'ghost'"),
    ]
    for args, expected in cases:
        code, _out, err = pigeon(db_url, *args)
        assert code == 1, args
        assert expected in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _out, err = pigeon(db_url, "user", "add", "acme", "x2", "--password-stdin", input="")
    assert code == 1 and "no password on standard input" in err
