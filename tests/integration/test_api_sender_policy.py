"""What the API remembers of keys and sender domains (`api.auth_cache`), on a real database: one
request asks once per sender domain; with the cache, a removed domain or a revoked key is refused
once the remembered answer runs out, and a new key or domain works at once; without it, from the
next request on. The clock of the memory is the test's, so nothing here waits."""

from __future__ import annotations

import dataclasses

import asyncpg
import pytest

from pigeon_mta.api.auth import Authenticator
from pigeon_mta.config import Duration, Settings
from pigeon_mta.intake.policy import SenderPolicy
from pigeon_mta.intake.refusal import Refusal
from pigeon_mta.intake.submission import Submitter
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store.apikeys import ApiKey


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _settings(auth_cache: float) -> Settings:
    settings = Settings()  # relay.sender_policy = strict
    return dataclasses.replace(
        settings, api=dataclasses.replace(settings.api, auth_cache=Duration(auth_cache))
    )


async def _acme_key(pool: asyncpg.Pool) -> ApiKey:
    acme = await store_orgs.ensure_org(pool, "acme")
    await store_domains.add_sender_domain(pool, acme, "acme.example")
    _row, secret = await store_apikeys.add_api_key(pool, acme, name="app")
    key = await store_apikeys.find_active_key(pool, secret)
    assert key is not None
    return key


def _submitter(key: ApiKey) -> Submitter:
    return Submitter(org_id=key.org_id, org=key.org, auth_user=f"apikey:{key.id}", api_key=True)


FROM_FIELD = [("from", "App <app@acme.example>")]


async def _sender(policy: SenderPolicy, key: ApiKey, domain: str, owned: dict[str, bool]) -> bool:
    """Whether the policy lets the key send as @domain."""
    refusal = await policy.check_sender(_submitter(key), domain, owned)
    assert refusal is None or isinstance(refusal, Refusal)
    return refusal is None


async def _originators(policy: SenderPolicy, key: ApiKey, owned: dict[str, bool]) -> bool:
    refusal = await policy.check_originators(_submitter(key), FROM_FIELD, owned, client="[test]")
    return refusal is None


async def test_without_the_cache_the_next_request_asks_again(pool: asyncpg.Pool) -> None:
    key = await _acme_key(pool)
    policy = SenderPolicy(_settings(0), pool)

    owned: dict[str, bool] = {}
    assert await _sender(policy, key, "acme.example", owned)
    assert owned == {"acme.example": True}
    async with pool.acquire() as conn:
        assert await store_domains.remove_sender_domain(conn, "acme.example") is not None
    # The same request: its From: is at the domain its envelope sender was checked against.
    assert await _originators(policy, key, owned)

    # The next request asks the database again, and the domain is no longer the org's.
    assert not await _sender(policy, key, "acme.example", {})
    assert not await _originators(policy, key, {})


async def test_a_removed_domain_is_refused_once_the_remembered_answer_runs_out(
    pool: asyncpg.Pool,
) -> None:
    key = await _acme_key(pool)
    clock = Clock()
    policy = SenderPolicy(_settings(1), pool, clock=clock)
    # A domain the org does not have is asked about at every request, so one added now is the
    # org's at the next request.
    assert not await _sender(policy, key, "new.example", {})
    await store_domains.add_sender_domain(pool, key.org_id, "new.example")
    assert await _sender(policy, key, "new.example", {})

    assert await _sender(policy, key, "acme.example", {})
    async with pool.acquire() as conn:
        assert await store_domains.remove_sender_domain(conn, "acme.example") is not None
    clock.now += 0.9
    assert await _sender(policy, key, "acme.example", {})  # remembered, for api.auth_cache at most
    assert await _originators(policy, key, {})
    clock.now += 0.2
    assert not await _sender(policy, key, "acme.example", {})
    assert not await _originators(policy, key, {})


@pytest.mark.parametrize("cache", [0.0, 1.0])
async def test_a_revoked_key_is_refused_once_the_remembered_answer_runs_out(
    pool: asyncpg.Pool, cache: float
) -> None:
    acme = await store_orgs.ensure_org(pool, "acme")
    clock = Clock()
    keys = Authenticator(pool, cache=cache, clock=clock)
    assert await keys.find("pgn_not-a-key") is None
    row, secret = await store_apikeys.add_api_key(pool, acme)
    found = await keys.find(secret)  # a new key works at once: a "no" is never remembered
    assert found is not None and found.id == row.id

    await store_apikeys.revoke_api_key(pool, row.id)
    clock.now += 0.9
    if cache:
        assert await keys.find(secret) == found
        clock.now += 0.2
    assert await keys.find(secret) is None
    clock.now += 5
    assert await keys.find(secret) is None
