"""`/v1/suppressions[/{address}]` of the real application on loopback, on PostgreSQL: the key's
org adds, reads, pages through and removes its entries with the rules of `pigeon-mta suppress`,
another org's key sees none of them, and bad bodies are refused with their problem.

aiohttp client ──HTTP──► ApiService 127.0.0.1:<free port> ── PostgreSQL
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from pigeon_mta.store import suppression as store_suppression
from tests.integration.api_helpers import Api, running_api
from tests.integration.test_api_reading import assert_problem, call


@pytest.fixture
async def api(pool: asyncpg.Pool) -> AsyncIterator[Api]:
    async with running_api(pool) as api:
        yield api


async def test_the_org_adds_reads_and_removes_an_entry_that_other_orgs_do_not_see(
    api: Api, pool: asyncpg.Pool
) -> None:
    entry = {"address": "Ann@Dest.Example", "reason": "asked to stop"}
    status, _headers, added = await call(api, "/v1/suppressions", method="POST", body=entry)
    assert status == 201, added
    assert (added["address"], added["reason"], added["source"]) == (
        "ann@dest.example",
        "asked to stop",
        "manual",
    )
    assert added["expires_at"] is None
    # The store's list, which the queue's claim and `pigeon-mta suppress list` read, has it.
    (stored,) = await store_suppression.list_suppressions(pool, api.acme)
    assert stored.address == "ann@dest.example" and stored.reason == "asked to stop"

    status, _headers, again = await call(
        api, "/v1/suppressions", method="POST", body={**entry, "reason": "again"}
    )
    assert status == 200 and again["reason"] == "again"
    status, _headers, shown = await call(api, "/v1/suppressions/ANN@dest.example")
    assert status == 200 and shown == again

    for method in ("GET", "DELETE"):
        status, headers, body = await call(
            api, "/v1/suppressions/ann@dest.example", key="other", method=method
        )
        assert_problem(status, headers, body, 404, "not-found")
    status, _headers, listed = await call(api, "/v1/suppressions", key="other")
    assert listed == {"suppressions": [], "next_cursor": None}

    status, _headers, body = await call(api, "/v1/suppressions/ann@dest.example", method="DELETE")
    assert status == 204 and body is None
    assert await store_suppression.list_suppressions(pool, api.acme) == []
    status, headers, body = await call(api, "/v1/suppressions/ann@dest.example", method="DELETE")
    assert_problem(status, headers, body, 404, "not-found")
    status, headers, body = await call(api, "/v1/suppressions/ann@dest.example")
    assert_problem(status, headers, body, 404, "not-found")


async def test_pages_hold_every_entry_once_while_entries_are_added(api: Api) -> None:
    for i in range(12):
        await call(
            api,
            "/v1/suppressions",
            method="POST",
            body={"address": f"u{i:02}@dest.example", "reason": "test"},
        )
    later = datetime.now(UTC) + timedelta(days=30)
    status, _headers, dated = await call(
        api,
        "/v1/suppressions",
        method="POST",
        body={"address": "u99@dest.example", "reason": "test", "expires_at": later.isoformat()},
    )
    assert status == 201 and dated["expires_at"].startswith(later.strftime("%Y-%m-%dT%H:%M"))
    seen: list[str] = []
    params = {"limit": "5"}
    for page_number in range(10):  # bounded: 13 entries in pages of 5
        status, _headers, page = await call(api, "/v1/suppressions", params=params)
        assert status == 200, page
        seen.extend(e["address"] for e in page["suppressions"])
        await call(
            api,
            "/v1/suppressions",
            method="POST",
            body={"address": f"a{page_number}@dest.example", "reason": "added meanwhile"},
        )
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == [f"u{i:02}@dest.example" for i in range(12)] + ["u99@dest.example"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "named"),
    [
        ({"reason": "x"}, 422, "invalid-field", "address"),
        ({"address": "nobody", "reason": "x"}, 422, "invalid-address", "address"),
        ({"address": "a b@dest.example", "reason": "x"}, 422, "invalid-address", "address"),
        ({"address": "ann@dest.example"}, 422, "invalid-field", "reason"),
        ({"address": "ann@dest.example", "reason": "a\r\nb"}, 422, "invalid-field", "reason"),
        (
            {"address": "ann@dest.example", "reason": "x", "expires_at": "soon"},
            422,
            "invalid-field",
            "expires_at",
        ),
        (
            {"address": "ann@dest.example", "reason": "x", "expires_at": "2001-01-01"},
            422,
            "invalid-field",
            "expires_at",
        ),
        ({"address": "ann@dest.example", "reason": "x", "why": "y"}, 422, "invalid-field", "why"),
        (["ann@dest.example"], 400, "invalid-json", ""),
    ],
)
async def test_a_bad_entry_is_refused_and_nothing_is_added(
    api: Api, pool: asyncpg.Pool, body: Any, status: int, kind: str, named: str
) -> None:
    got, headers, answer = await call(api, "/v1/suppressions", method="POST", body=body)
    assert_problem(got, headers, answer, status, kind)
    assert not named or f"'{named}'" in answer["detail"]
    assert await pool.fetchval("SELECT count(*) FROM suppression") == 0


async def test_a_bad_page_parameter_is_400_naming_it(api: Api) -> None:
    for params, named in (({"limit": "0"}, "limit"), ({"offset": "3"}, "offset")):
        status, headers, body = await call(api, "/v1/suppressions", params=params)
        assert_problem(status, headers, body, 400, "invalid-parameter")
        assert f"'{named}'" in body["detail"]
