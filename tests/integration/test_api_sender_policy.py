"""The API's sender policy on a real database: one request asks once per sender domain, and a
domain removed from the org is refused from the next request on."""

from __future__ import annotations

import asyncpg
import pytest

from pigeon_mta.api import problems
from pigeon_mta.api.policy import ApiSenderPolicy
from pigeon_mta.api.problems import Problem
from pigeon_mta.config import Settings
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.submission.addresses import Mailbox, parse_mailbox


async def test_a_request_keeps_its_answer_and_the_next_asks_again(pool: asyncpg.Pool) -> None:
    acme = await store_orgs.ensure_org(pool, "acme")
    await store_domains.add_sender_domain(pool, acme, "acme.example")
    _row, secret = await store_apikeys.add_api_key(pool, acme, name="app")
    key = await store_apikeys.find_active_key(pool, secret)
    assert key is not None
    sender = parse_mailbox("app@acme.example", smtputf8=False)
    assert isinstance(sender, Mailbox)
    policy = ApiSenderPolicy(Settings(), pool)  # relay.sender_policy = strict
    from_field = [("from", "App <app@acme.example>")]

    owned: dict[str, bool] = {}
    await policy.check_sender(key, sender, owned)
    assert owned == {"acme.example": True}
    async with pool.acquire() as conn:
        assert await store_domains.remove_sender_domain(conn, "acme.example") is not None
    # The same request: its From: is at the domain its envelope sender was checked against.
    await policy.check_originators(key, from_field, owned)

    # The next request asks the database again, and the domain is no longer the org's.
    for check in (
        policy.check_sender(key, sender, {}),
        policy.check_originators(key, from_field, {}),
    ):
        with pytest.raises(Problem) as refused:
            await check
        assert refused.value.kind is problems.SENDER_NOT_OWNED
