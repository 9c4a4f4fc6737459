"""README's outbox examples (psycopg, SQLAlchemy), taken from README.md itself and run as an
application runs them against its own database, with `pigeon-mta serve` relaying the outbox that
`outbox install` created there; only the database URL is replaced. A rollback in the same
transaction sends nothing.

psycopg / SQLAlchemy script ──one transaction──► app database (orders, pigeon_outbox)
                         serve (OutboxRelay) ──claim, write back──┘
                         serve ──queue──► pigeon-mta's database ──SMTP──► sink 127.0.0.2
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import asyncpg

from tests.e2e.relay_serve import pigeon_with, relay_serve
from tests.e2e.shared import readme_block

README_URL = "postgresql://shop@db.internal/shop"
README_SQLALCHEMY_URL = "postgresql+psycopg://shop@db.internal/shop"


def run_script(source: str, cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", source], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def test_readme_outbox_examples_send_their_order_emails_once(
    tmp_path: Path, db_url: str, app_db_url: str
) -> None:
    app = await asyncpg.connect(app_db_url)
    await app.execute("CREATE TABLE orders (id bigint PRIMARY KEY, total numeric NOT NULL)")
    try:
        async with relay_serve(
            tmp_path,
            db_url,
            node_name="e2e-readme-outbox",
            outboxes=[{"name": "shop", "database": app_db_url, "org": "acme"}],
        ) as relay:
            await pigeon_with(relay.config, "outbox", "install", "shop")
            psycopg_example = readme_block("python", "psycopg.connect(DATABASE_URL)")
            assert README_URL in psycopg_example
            await asyncio.to_thread(
                run_script, psycopg_example.replace(README_URL, app_db_url), tmp_path
            )
            sqlalchemy_example = readme_block("python", "engine.begin()")
            assert README_SQLALCHEMY_URL in sqlalchemy_example
            url = app_db_url.replace("postgresql://", "postgresql+psycopg://", 1)
            await asyncio.to_thread(
                run_script, sqlalchemy_example.replace(README_SQLALCHEMY_URL, url), tmp_path
            )
            # An order rolled back with its email: nothing is sent for it.
            try:
                async with app.transaction():
                    await app.execute("INSERT INTO orders (id, total) VALUES (1003, 1)")
                    await app.execute(
                        """INSERT INTO pigeon_outbox (idempotency_key, message) VALUES
                           ('order-1003-confirmation', '{"from": "shop@acme.example",
                            "to": ["buyer@example.net"], "text": "x"}')"""
                    )
                    raise LookupError("payment declined")
            except LookupError:
                pass
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(relay.sink.messages) < 2:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # time for a third message, were one to come
            subjects = sorted(
                m.data.split(b"Subject: ", 1)[1].split(b"\r\n", 1)[0] for m in relay.sink.messages
            )
            assert subjects == [b"Your order 1001", b"Your order 1002"]
            rows = await app.fetch(
                "SELECT idempotency_key, queue_id, error FROM pigeon_outbox ORDER BY id"
            )
            assert [(r["idempotency_key"], r["error"]) for r in rows] == [
                ("order-1001-confirmation", None),
                ("order-1002-confirmation", None),
            ]
            for row in rows:
                shown = await pigeon_with(relay.config, "log", str(row["queue_id"]))
                assert "Delivered" in shown or "delivered" in shown, shown
    finally:
        await app.close()
    assert relay.exit_code == 0, relay.serve.output
