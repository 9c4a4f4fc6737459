"""`GET /v1/messages` pages through an org's history through indexes: a page reads about a page.

On the history of test_admin_plans (8,000 finished messages, 2,000 of them to one address, a tenth
bounced, and a live queue), each filter of store/message_pages.py is planned on the index meant
for it (EXPLAIN) and reads a few hundred rows at most, on the first page and on a later one,
whatever the history's size (pg_stat_xact_user_tables). No timing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from pigeon_mta.store import message_pages
from pigeon_mta.store.message_pages import Filters, Position
from tests.integration.test_admin_plans import HOT, big, reads_of

__all__ = ["big"]  # the fixture, shared with test_admin_plans

PAGE = 20
CASES = {
    "none": Filters(),
    "recipient": Filters(addresses=(HOT, HOT.upper())),
    "status": Filters(status="bounced"),
    "live status": Filters(status="queued"),
    "since": Filters(since=datetime.now(UTC) - timedelta(days=35)),
    "recipient and status": Filters(addresses=(HOT,), status="delivered"),
}


def plan_nodes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from plan_nodes(item)
    elif isinstance(node, dict):
        yield node
        for key in ("Plan", "Plans"):
            if key in node:
                yield from plan_nodes(node[key])


async def scans(
    conn: asyncpg.Connection, org_id: uuid.UUID, filters: Filters, after: Position | None
) -> set[tuple[str, str | None, str | None]]:
    sql, arguments = message_pages.listing_statement(org_id, filters, after=after, limit=PAGE)
    plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, *arguments)
    nodes = plan_nodes(json.loads(plan) if isinstance(plan, str) else plan)
    return {
        (n["Node Type"], n.get("Relation Name"), n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") in ("message", "recipient")
    }


@pytest.mark.parametrize("case", list(CASES))
async def test_a_page_reads_about_a_page_through_its_index(
    big: asyncpg.Connection, org_id: uuid.UUID, case: str
) -> None:
    filters = CASES[case]
    async with big.transaction():
        first, read = await reads_of(
            big, lambda: message_pages.list_messages(big, org_id, filters, after=None, limit=PAGE)
        )
        assert len(first) == PAGE
        after = Position(first[-1].received_at, first[-1].queue_id)
        second, later_read = await reads_of(
            big, lambda: message_pages.list_messages(big, org_id, filters, after=after, limit=PAGE)
        )
        plans = [await scans(big, org_id, filters, None), await scans(big, org_id, filters, after)]
    assert len(second) == PAGE and not {m.queue_id for m in first} & {m.queue_id for m in second}
    for reads in (read, later_read):
        for table in ("message", "recipient"):
            assert reads[table].seq_scan == 0, (table, reads[table])
            assert reads[table].rows < 400, (table, reads[table])
    for plan in plans:
        assert all(kind != "Seq Scan" for kind, _table, _index in plan), plan
        indexes = {index for _kind, _table, index in plan}
        if filters.addresses:
            assert "recipient_address" in indexes, plan
        elif filters.status in message_pages.FAILED:
            assert "recipient_failed" in indexes, plan
        else:
            assert "message_org_received" in indexes, plan


async def test_a_message_id_is_found_through_its_index(
    big: asyncpg.Connection, org_id: uuid.UUID
) -> None:
    header_id = "needle@example.com"
    target = await big.fetchval(
        "UPDATE message SET header_message_id = $1 WHERE id = "
        "(SELECT id FROM message ORDER BY received_at LIMIT 1) RETURNING id",
        header_id,
    )
    filters = Filters(header_id=header_id)
    async with big.transaction():
        found, read = await reads_of(
            big, lambda: message_pages.list_messages(big, org_id, filters, after=None, limit=PAGE)
        )
        plan = await scans(big, org_id, filters, None)
    assert [m.queue_id for m in found] == [target]
    assert read["message"].seq_scan == 0 and read["message"].rows < 10, read["message"]
    assert ("message", "message_header_id") in {(t, i) for _k, t, i in plan}, plan
