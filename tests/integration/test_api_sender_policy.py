"""What the API remembers of keys and sender domains (`api.auth_cache`), on a real database: one
request asks once per sender domain; with the cache, a removed domain or a revoked key is refused
once the remembered answer runs out, and a new key or domain works at once; without it, from the
next request on. The clock of the memory is the test's, so nothing here waits."""

from __future__ import annotations

import dataclasses

import asyncpg
import pytest

from pigeon_mta.api import problems
from pigeon_mta.api.auth import Authenticator
from pigeon_mta.api.policy import ApiSenderPolicy
from pigeon_mta.api.problems import Problem
from pigeon_mta.config import Duration, Settings
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store.apikeys import ApiKey
from pigeon_mta.submission.addresses import Mailbox, parse_mailbox


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


async def _refused(check: object) -> None:
    with pytest.raises(Problem) as refused:
        await check  # type: ignore[misc]
    assert refused.value.kind is problems.SENDER_NOT_OWNED


SENDER = parse_mailbox("app@acme.example", smtputf8=False)
FROM_FIELD = [("from", "App <app@acme.example>")]


async def test_without_the_cache_the_next_request_asks_again(pool: asyncpg.Pool) -> None:
    key = await _acme_key(pool)
    assert isinstance(SENDER, Mailbox)
    policy = ApiSenderPolicy(_settings(0), pool)

    owned: dict[str, bool] = {}
    await policy.check_sender(key, SENDER, owned)
    assert owned == {"acme.example": True}
    async with pool.acquire() as conn:
        assert await store_domains.remove_sender_domain(conn, "acme.example") is not None
    # The same request: its From: is at the domain its envelope sender was checked against.
    await policy.check_originators(key, FROM_FIELD, owned)

    # The next request asks the database again, and the domain is no longer the org's.
    await _refused(policy.check_sender(key, SENDER, {}))
    await _refused(policy.check_originators(key, FROM_FIELD, {}))


async def test_a_removed_domain_is_refused_once_the_remembered_answer_runs_out(
    pool: asyncpg.Pool,
) -> None:
    key = await _acme_key(pool)
    assert isinstance(SENDER, Mailbox)
    clock = Clock()
    policy = ApiSenderPolicy(_settings(1), pool, clock=clock)
    # A domain the org does not have is asked about at every request, so one added now is the
    # org's at the next request.
    other = parse_mailbox("app@new.example", smtputf8=False)
    assert isinstance(other, Mailbox)
    await _refused(policy.check_sender(key, other, {}))
    await store_domains.add_sender_domain(pool, key.org_id, "new.example")
    await policy.check_sender(key, other, {})

    await policy.check_sender(key, SENDER, {})
    async with pool.acquire() as conn:
        assert await store_domains.remove_sender_domain(conn, "acme.example") is not None
    clock.now += 0.9
    await policy.check_sender(key, SENDER, {})  # remembered, for api.auth_cache at most
    await policy.check_originators(key, FROM_FIELD, {})
    clock.now += 0.2
    await _refused(policy.check_sender(key, SENDER, {}))
    await _refused(policy.check_originators(key, FROM_FIELD, {}))


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
