"""An application's database beside pigeon-mta's, with its outbox installed, for the outbox tests.

application (asyncpg) ──INSERT, one transaction──► app database: orders + pigeon_outbox
                                                    │ OutboxRelay (claim, write back)
                                                    ▼
                          pigeon-mta's database ◄── Intake, GroupCommit
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from pigeon_mta.config import OutboxSettings
from pigeon_mta.outbox.table import ddl

ORDERS = "CREATE TABLE orders (id bigint PRIMARY KEY, total numeric NOT NULL)"


async def install(app_db_url: str) -> None:
    """The application's orders table and its outbox (`outbox install`'s DDL)."""
    conn = await asyncpg.connect(app_db_url)
    try:
        await conn.execute(ORDERS)
        await conn.execute(ddl("pigeon_outbox"))
    finally:
        await conn.close()


def outbox_settings(app_db_url: str, **changes: Any) -> OutboxSettings:
    return OutboxSettings(name="shop", database=app_db_url, org="acme", **changes)


def api_message(n: int, *, sender: str = "shop@acme.example", to: str = "buyer@dest.test") -> str:
    """The HTTP API's JSON form of one order's confirmation."""
    return json.dumps(
        {
            "from": sender,
            "to": [to],
            "subject": f"order {n}",
            "text": f"Thank you for order {n}.",
            "headers": {"Message-ID": f"<order-{n}@shop.example>"},
        }
    )


async def write_order(
    conn: asyncpg.Connection, n: int, *, message: str | None = None, key: str | None = None
) -> None:
    """The application's one transaction: its order and the order's email."""
    async with conn.transaction():
        await conn.execute("INSERT INTO orders (id, total) VALUES ($1, 10)", n)
        await conn.execute(
            "INSERT INTO pigeon_outbox (idempotency_key, message) VALUES ($1, $2::jsonb)",
            key or f"order-{n}",
            message or api_message(n),
        )
