"""The engine's sign step against a real database: which keys sign which delivery, rotation, the
cache, unsigned mail and its counters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from prometheus_client import REGISTRY

from pigeon_mta import dkim
from pigeon_mta.signer import DkimSigner, KeysUnavailable
from pigeon_mta.store import dkim_keys as store_dkim_keys
from tests.integration.dkim_helpers import add_key, add_sender_domain, delivery
from tests.peers.dkim_samples import SAMPLES
from tests.peers.dkim_verify import DkimZone, dkimpy_verify, opendkim_verify

T = 1_764_428_400
MESSAGE = SAMPLES["plain"]  # From: Alice <alice@example.com>


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _selectors(signed: bytes) -> list[str]:
    fields = signed.split(b"\r\n\r\n", 1)[0].replace(b"\r\n ", b" ").split(b"\r\n")
    return [
        f.split(b" s=", 1)[1].split(b";", 1)[0].decode()
        for f in fields
        if f.startswith(b"DKIM-Signature:")
    ]


@pytest.fixture
async def signer(pool: asyncpg.Pool) -> AsyncIterator[DkimSigner]:
    signer = DkimSigner(pool, cache_ttl=0, clock=lambda: T)
    yield signer
    signer.close()


async def test_signs_with_the_orgs_active_key_and_verifies(
    pool: asyncpg.Pool, signer: DkimSigner
) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    _key, record = await add_key(pool, domain, "s1")
    before = _count("pigeon_dkim_signatures_total", algorithm="rsa")

    signed = (await signer(delivery(domain.org_id, MESSAGE))).body

    assert signed.endswith(MESSAGE) and signed.startswith(b"DKIM-Signature:")
    assert b" t=%d;" % T in signed.replace(b"\r\n ", b" ")
    assert _count("pigeon_dkim_signatures_total", algorithm="rsa") == before + 1
    with DkimZone({"s1._domainkey.example.com": record}) as zone:
        assert dkimpy_verify(signed, zone) == [True]
        assert opendkim_verify(signed, zone).ok


async def test_rsa_and_ed25519_keys_give_two_signatures(
    pool: asyncpg.Pool, signer: DkimSigner
) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    _k1, rsa_record = await add_key(pool, domain, "r1", "rsa")
    _k2, ed_record = await add_key(pool, domain, "e1", "ed25519")
    before = _count("pigeon_dkim_signatures_total", algorithm="ed25519")

    signed = (await signer(delivery(domain.org_id, MESSAGE))).body

    assert _selectors(signed) == ["r1", "e1"]  # RSA on top, for verifiers that read only one
    assert _count("pigeon_dkim_signatures_total", algorithm="ed25519") == before + 1
    records = {"r1._domainkey.example.com": rsa_record, "e1._domainkey.example.com": ed_record}
    with DkimZone(records) as zone:
        assert dkimpy_verify(signed, zone) == [True, True]


async def test_no_key_means_unsigned_and_counted(pool: asyncpg.Pool, signer: DkimSigner) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    before = _count("pigeon_dkim_unsigned_total", reason="no_key")

    assert (await signer(delivery(domain.org_id, MESSAGE))).body == MESSAGE

    assert _count("pigeon_dkim_unsigned_total", reason="no_key") == before + 1


async def test_another_orgs_domain_is_not_signed(pool: asyncpg.Pool, signer: DkimSigner) -> None:
    theirs = await add_sender_domain(pool, "other", "example.com")
    await add_key(pool, theirs, "s1")
    ours = await add_sender_domain(pool, "acme", "acme.example")

    assert (await signer(delivery(ours.org_id, MESSAGE))).body == MESSAGE


@pytest.mark.parametrize(
    ("reason", "bodies"),
    [
        (
            "no_from_domain",
            (
                b"To: bob@example.net\r\n\r\nno From\r\n",
                b"From: a@example.com\r\nFrom: b@example.com\r\n\r\ntwo From fields\r\n",
                b"From: a@b\xff.example\r\n\r\nnot UTF-8\r\n",
            ),
        ),
        # The From: domain has a key, but a header line is neither a field nor a continuation
        # (not something reception queues; a queued message must never be held for it).
        (
            "malformed",
            (
                b"From: a@example.com\r\nno colon on this line\r\n\r\nbody\r\n",
                b" a continuation first\r\nFrom: a@example.com\r\n\r\nbody\r\n",
                # A From: the parser would recurse on 20,000 times, and one of more addresses
                # than limits.max_from_addresses (a trusted client's message is queued unread).
                b"From: " + b"(" * 20_000 + b")" * 20_000 + b" a@example.com\r\n\r\nbody\r\n",
                b"From: " + b", ".join(b"u%d@example.com" % i for i in range(101)) + b"\r\n\r\nx",
            ),
        ),
    ],
)
async def test_messages_it_cannot_sign_go_out_unsigned_and_are_counted(
    pool: asyncpg.Pool, signer: DkimSigner, reason: str, bodies: tuple[bytes, ...]
) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    await add_key(pool, domain, "s1")
    before = _count("pigeon_dkim_unsigned_total", reason=reason)
    for body in bodies:
        assert (await signer(delivery(domain.org_id, body))).body == body
    assert _count("pigeon_dkim_unsigned_total", reason=reason) == before + len(bodies)


async def test_a_from_domain_that_is_no_valid_idn_goes_unsigned(
    pool: asyncpg.Pool, signer: DkimSigner
) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    await add_key(pool, domain, "s1")
    # A label over 63 characters: no domain name, so no sender domain's key applies.
    body = ("From: a@" + "ü" * 64 + ".example\r\n\r\nx\r\n").encode()
    assert (await signer(delivery(domain.org_id, body))).body == body


async def test_a_damaged_stored_key_is_skipped(pool: asyncpg.Pool, signer: DkimSigner) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    damaged, _record = await add_key(pool, domain, "r1", "rsa")
    await pool.execute("UPDATE dkim_key SET private_key = 'not a key' WHERE id = $1", damaged.id)
    assert (await signer(delivery(domain.org_id, MESSAGE))).body == MESSAGE
    await add_key(pool, domain, "e1", "ed25519")
    assert _selectors((await signer(delivery(domain.org_id, MESSAGE))).body) == ["e1"]


async def test_rotation_signs_queued_mail_with_the_key_active_at_send_time(
    pool: asyncpg.Pool, signer: DkimSigner
) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    await add_key(pool, domain, "old")
    queued = delivery(domain.org_id, MESSAGE)  # claimed later, after the rotation
    assert _selectors((await signer(queued)).body) == ["old"]

    new, _record = await add_key(pool, domain, "new")
    assert not new.active  # waits for its DNS record
    assert _selectors((await signer(queued)).body) == ["old"]

    async with pool.acquire() as conn:
        result = await store_dkim_keys.activate_key(conn, domain.id, "new")
    assert result is not None and result[1] == ["old"]
    assert _selectors((await signer(queued)).body) == ["new"]

    await store_dkim_keys.deactivate_key(pool, domain.id, "new")
    assert (await signer(queued)).body == MESSAGE


async def test_lookups_are_cached_for_the_ttl(pool: asyncpg.Pool) -> None:
    domain = await add_sender_domain(pool, "acme", "example.com")
    await add_key(pool, domain, "s1")
    signer = DkimSigner(pool, cache_ttl=3600)
    try:
        assert _selectors((await signer(delivery(domain.org_id, MESSAGE))).body) == ["s1"]
        await store_dkim_keys.deactivate_key(pool, domain.id, "s1")
        # Within the TTL the cached key still signs; `cache_ttl` bounds how long.
        assert _selectors((await signer(delivery(domain.org_id, MESSAGE))).body) == ["s1"]
    finally:
        signer.close()


async def test_database_outage_uses_cached_keys_else_raises(db_url: str) -> None:
    pool = await asyncpg.create_pool(db_url, min_size=1, max_size=2)
    assert pool is not None
    domain = await add_sender_domain(pool, "acme", "example.com")
    other = await add_sender_domain(pool, "acme", "other.example")
    await add_key(pool, domain, "s1")
    await add_key(pool, other, "s1")
    signer = DkimSigner(pool, cache_ttl=0)
    try:
        assert _selectors((await signer(delivery(domain.org_id, MESSAGE))).body) == ["s1"]
        await pool.close()
        # Cached keys keep signing through the outage (up to stale_ttl) ...
        assert _selectors((await signer(delivery(domain.org_id, MESSAGE))).body) == ["s1"]
        # ... and a domain never looked up is not sent unsigned: the engine retries it later.
        other_message = MESSAGE.replace(b"alice@example.com", b"alice@other.example")
        with pytest.raises(KeysUnavailable):
            await signer(delivery(domain.org_id, other_message))
    finally:
        signer.close()


async def test_concurrent_deliveries_are_signed_one_per_loop_iteration(pool: asyncpg.Pool) -> None:
    """A claimed batch signs one message per loop iteration: other work (here a ticking task, in
    the service every other connection) runs between any two signatures, and each delivery gets
    the same bytes as a direct call."""
    domain = await add_sender_domain(pool, "acme", "example.com")
    await add_key(pool, domain, "r1", "rsa")
    await add_key(pool, domain, "e1", "ed25519")
    signer = DkimSigner(pool, clock=lambda: T)
    keys = await signer.keys_for(domain.org_id, "example.com")
    job = delivery(domain.org_id, SAMPLES["eight_bit"])
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    ticking = asyncio.create_task(ticker())
    try:
        await asyncio.sleep(0)
        start = ticks
        signed = await asyncio.gather(*(signer(job) for _ in range(20)))
        assert ticks - start >= 20  # the loop turned at least once per signature
        assert [s.body for s in signed] == [dkim.sign(job.body, keys, timestamp=T) + job.body] * 20
    finally:
        stop.set()
        await ticking
        signer.close()
