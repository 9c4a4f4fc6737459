"""Clients that misbehave on purpose: forged Authentication-Results, routing loops, junk commands.

client (127.0.0.1, trusted) ──SMTP──► relay listener ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg

from tests.integration.submission_helpers import (
    HOSTNAME,
    make_settings,
    message_rows,
    running_service,
    smtp_client,
)


async def test_forged_results_hidden_behind_comments_are_removed(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """RFC 8601 2.2 allows CFWS around the authserv-id: a comment before or after our host name
    does not make a forged field someone else's."""
    forged = (
        f"Authentication-Results: (c) {HOSTNAME}; dkim=pass header.d=bank.example\r\n"
        f"Authentication-Results: {HOSTNAME}(c); spf=pass smtp.mailfrom=bank.example\r\n"
        f"Authentication-Results: (a (b) c) {HOSTNAME.upper()} (d); dmarc=pass\r\n"
        "Authentication-Results: other.example (c); spf=pass\r\n"
    )
    async with running_service(
        make_settings(tmp_path, db_url, None, modes=("relay",)), pool
    ) as running:

        def send() -> int:
            with smtp_client(running.port("relay")) as client:
                client.ehlo()
                client.mail("app@host.internal")
                client.rcpt("bob@example.net")
                code, _ = client.data(f"{forged}Subject: hi\r\n\r\nbody\r\n".encode())
                return code

        assert await asyncio.to_thread(send) == 250
    [row] = await message_rows(pool)
    header = bytes(row["body"]).split(b"\r\n\r\n", 1)[0]
    assert b"dkim=pass" not in header
    assert b"spf=pass smtp.mailfrom=bank.example" not in header
    assert b"dmarc=pass" not in header
    assert b"Authentication-Results: other.example (c); spf=pass\r\n" in header
    assert header.count(b"Authentication-Results:") == 2  # ours and other.example's


def _send_with_received(port: int, hops: int, body_lines: int = 0) -> tuple[int, bytes]:
    trace = "".join(
        f"Received: from hop{n}.example by hop{n + 1}.example; Mon, 1 Jan 2024 00:00:00 +0000\r\n"
        for n in range(hops)
    )
    quoted = "Received: from quoted.example\r\n" * body_lines  # in the body: not a hop
    with smtp_client(port) as client:
        client.ehlo()
        client.mail("app@host.internal")
        client.rcpt("bob@example.net")
        return client.data(f"{trace}Subject: loop?\r\n\r\n{quoted}body\r\n".encode())


async def test_a_message_over_the_hop_limit_is_refused(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """limits.max_hops (50) Received fields at most, ours included, as Postfix's hopcount_limit:
    a routing loop ends at the 50th hop instead of circulating until delivery.max_age."""
    async with running_service(
        make_settings(tmp_path, db_url, None, modes=("relay",)), pool
    ) as running:
        port = running.port("relay")
        looping = await asyncio.to_thread(_send_with_received, port, 50)
        last_hop = await asyncio.to_thread(_send_with_received, port, 49)
        quoting = await asyncio.to_thread(_send_with_received, port, 1, 200)
    assert looping == (554, b"5.4.6 Too many hops")
    assert last_hop[0] == 250 and quoting[0] == 250
    last_body, quoting_body = [bytes(r["body"]) for r in await message_rows(pool)]
    assert last_body.split(b"\r\n\r\n", 1)[0].count(b"Received:") == 50
    assert quoting_body.count(b"Received: from quoted.example") == 200
