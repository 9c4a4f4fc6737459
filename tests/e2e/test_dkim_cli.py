"""The real `pigeon-mta dkim` commands: the record keygen prints is the one that verifies our
signatures; rotation; clear refusals; private keys never printed."""

from __future__ import annotations

import json
import re

import asyncpg

from pigeon_mta.signer import DkimSigner
from tests.conftest import run_pigeon
from tests.integration.dkim_helpers import add_sender_domain, delivery
from tests.peers.dkim_samples import SAMPLES
from tests.peers.dkim_verify import DkimZone, mail_dkim_verify, opendkim_verify

ZONE_LINE = re.compile(
    r'^(\S+)\._domainkey\.example\.com\. IN TXT ("[^"]{1,255}")( "[^"]{1,255}")*$'
)


def _run(db_url: str, *args: str) -> tuple[int, str, str]:
    result = run_pigeon(*args, env={"PIGEON_DATABASE_URL": db_url})
    assert "PRIVATE KEY" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return result.returncode, result.stdout, result.stderr


async def test_keygen_refuses_a_domain_no_org_has_added(db_url: str) -> None:
    code, out, err = _run(db_url, "dkim", "keygen", "nobody.example")
    assert code == 1 and out == ""
    assert err.strip() == (
        "pigeon-mta: no org has added the domain nobody.example; "
        "add it first with: pigeon-mta domain add ORG nobody.example"
    )


async def test_keygen_record_verifies_signed_mail(db_url: str, pool: asyncpg.Pool) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")

    code, out, _err = _run(db_url, "dkim", "keygen", "example.com", "--selector", "s1")
    assert code == 0
    line = out.strip()
    assert ZONE_LINE.match(line), line
    assert line.startswith('s1._domainkey.example.com. IN TXT "v=DKIM1; k=rsa; p=')

    code, out, _err = _run(
        db_url,
        "dkim",
        "keygen",
        "example.com",
        "--algorithm",
        "ed25519",
        "--selector",
        "e1",
        "--json",
    )
    assert code == 0
    ed = json.loads(out)
    assert ed["name"] == "e1._domainkey.example.com"
    assert ed["value"].startswith("v=DKIM1; k=ed25519; p=")

    code, out, _err = _run(db_url, "dkim", "list", "--json")
    listed = {k["selector"]: k for k in json.loads(out)}
    assert set(listed) == {"s1", "e1"}
    assert all(k["active"] and k["domain"] == "example.com" for k in listed.values())
    assert listed["s1"]["bits"] == 2048 and listed["e1"]["algorithm"] == "ed25519"
    # The zone line's strings, joined, are the record value.
    assert "".join(re.findall(r'"([^"]*)"', line)) == listed["s1"]["value"]

    signer = DkimSigner(pool)
    try:
        signed = (await signer(delivery(domain.org_id, SAMPLES["eight_bit"]))).body
    finally:
        signer.close()
    records = {k["name"]: k["value"] for k in listed.values()}
    with DkimZone(records) as zone:
        assert opendkim_verify(signed, zone).ok
        assert mail_dkim_verify(signed, zone)[0].result == "pass"


async def test_rotation_commands(db_url: str, pool: asyncpg.Pool) -> None:
    await add_sender_domain(pool, "acme", "example.com")
    assert (
        _run(db_url, "dkim", "keygen", "example.com", "--selector", "old", "--bits", "1024")[0] == 0
    )

    code, out, err = _run(db_url, "dkim", "keygen", "example.com", "--selector", "new")
    assert code == 0 and out.startswith("new._domainkey.example.com. IN TXT")
    assert "pigeon-mta dkim activate example.com new" in err

    code, out, _err = _run(db_url, "dkim", "list")
    header, *rows = out.splitlines()
    assert header.split()[:6] == ["DOMAIN", "SELECTOR", "ALGORITHM", "BITS", "CREATED_AT", "ACTIVE"]
    state = {row.split()[1]: row.split()[6] for row in rows}  # created_at takes two columns
    assert state == {"old": "yes", "new": "no"}

    code, out, _err = _run(db_url, "dkim", "activate", "example.com", "new", "--json")
    assert code == 0 and json.loads(out)["replaced"] == "old"
    code, out, _err = _run(db_url, "dkim", "list", "--json")
    assert {k["selector"]: k["active"] for k in json.loads(out)} == {"old": False, "new": True}

    code, out, _err = _run(db_url, "dkim", "deactivate", "example.com", "new", "--json")
    assert code == 0 and json.loads(out)["active"] is False


async def test_clear_refusals(db_url: str, pool: asyncpg.Pool) -> None:
    await add_sender_domain(pool, "acme", "example.com")
    assert (
        _run(db_url, "dkim", "keygen", "example.com", "--selector", "s1", "--algorithm", "ed25519")[
            0
        ]
        == 0
    )
    for args, message in (
        (
            ("keygen", "example.com", "--selector", "s1", "--algorithm", "ed25519"),
            "already has a key with selector 's1'",
        ),
        (("keygen", "example.com", "--bits", "8192"), "1024 to 4096"),
        (("keygen", "example.com", "--selector", "bad_selector!"), "not a valid selector"),
        (("activate", "example.com", "missing"), "has no key with selector 'missing'"),
        (("list", "--domain", "bad..example"), "'bad..example' is not a valid domain name"),
        (("keygen", "bad..example"), "'bad..example' is not a valid domain name"),
    ):
        code, out, err = _run(db_url, "dkim", *args)
        assert code == 1 and out == "", args
        assert message in err and len(err.strip().splitlines()) == 1, err
