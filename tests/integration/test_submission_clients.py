"""Real clients (smtplib, aiosmtplib) over STARTTLS and implicit TLS: AUTH, send, find it queued.

client ──STARTTLS / implicit TLS + AUTH──► listeners (TLS from a test CA) ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import smtplib
from email.message import EmailMessage
from pathlib import Path

import aiosmtplib
import asyncpg

from tests.integration.submission_helpers import (
    HOSTNAME,
    Running,
    add_user,
    make_settings,
    make_tls,
    message,
    message_rows,
    queue_id_of,
    running_service,
    smtp_client,
)


async def test_smtplib_starttls_auth_send(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def send() -> tuple[int, bytes]:
            with smtp_client(running.port("submission")) as client:
                client.starttls(context=tls.client_context())
                client.login(user.username, user.password)  # smtplib picks PLAIN
                client.mail("app@acme.example")
                client.rcpt("bob@example.net")
                client.rcpt("carol@example.org")
                return client.data(message("app@acme.example", "bob@example.net"))

        code, reply = await asyncio.to_thread(send)
    assert code == 250
    queue_id = queue_id_of(reply)
    assert reply.startswith(b"2.0.0 Ok: queued as ")
    [row] = await message_rows(pool)
    assert row["id"] == queue_id
    assert row["org_id"] == user.org_id
    assert row["sender"] == "app@acme.example"
    assert row["recipients"] == ["bob@example.net", "carol@example.org"]
    assert row["listener"] == "submission"
    assert row["auth_user"] == "alice" and row["credential_id"] == user.credential_id
    assert str(row["client_ip"]) == "127.0.0.1"
    body = bytes(row["body"])
    # RFC 6409 fixups: trace on top, Message-ID and Date added.
    assert body.startswith(b"Received: from ")
    assert f"by {HOSTNAME} (pigeon-mta) with ESMTPSA id {queue_id}".encode() in body
    assert f"Authentication-Results: {HOSTNAME}; auth=pass smtp.auth=alice".encode() in body
    assert b"\r\nMessage-ID: <" in body and b"\r\nDate: " in body
    assert row["header_message_id"] and row["header_message_id"].endswith("@" + HOSTNAME)
    statuses = await pool.fetch("SELECT status FROM recipient WHERE message_id = $1", queue_id)
    assert [r["status"] for r in statuses] == ["queued", "queued"]


async def test_smtplib_implicit_tls_auth_login(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def send() -> tuple[int, bytes]:
            with smtplib.SMTP_SSL(
                "127.0.0.1", running.port("submissions"), context=tls.client_context(), timeout=30
            ) as client:
                client.ehlo()
                assert "LOGIN" in client.esmtp_features["auth"]
                client.user, client.password = user.username, user.password
                client.auth("LOGIN", client.auth_login)
                client.mail("app@acme.example")
                client.rcpt("bob@example.net")
                return client.data(message("app@acme.example", "bob@example.net"))

        code, reply = await asyncio.to_thread(send)
    assert code == 250
    [row] = await message_rows(pool)
    assert row["id"] == queue_id_of(reply)
    assert row["listener"] == "submissions"
    assert b"with ESMTPSA id" in bytes(row["body"])
    assert b"(using TLSv1." in bytes(row["body"])


async def _aiosmtplib_send(running: Running, listener: str, **tls: object) -> str:
    user_message = EmailMessage()
    user_message["From"] = "App <app@acme.example>"
    user_message["To"] = "bob@example.net"
    user_message["Subject"] = "hello from aiosmtplib"
    user_message.set_content("Body text.\n.leading dot\n")
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=running.port(listener), timeout=30, **tls)  # type: ignore[arg-type]
    async with client:
        await client.login("alice", "correct horse battery staple")
        refused, reply = await client.send_message(user_message)
    assert refused == {}
    return reply


async def test_aiosmtplib_starttls(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:
        reply = await _aiosmtplib_send(
            running, "submission", start_tls=True, tls_context=tls.client_context()
        )
    [row] = await message_rows(pool)
    assert row["id"] == queue_id_of(reply)
    assert row["recipients"] == ["bob@example.net"]
    # The dot-stuffed line came through unstuffed.
    assert b"\r\n.leading dot\r\n" in bytes(row["body"])


async def test_aiosmtplib_implicit_tls(tmp_path: Path, db_url: str, pool: asyncpg.Pool) -> None:
    tls = make_tls(tmp_path)
    await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:
        reply = await _aiosmtplib_send(
            running, "submissions", use_tls=True, tls_context=tls.client_context()
        )
    [row] = await message_rows(pool)
    assert row["id"] == queue_id_of(reply)
    assert row["listener"] == "submissions"


async def test_trusted_network_relays_without_auth_as_the_trusted_org(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    async with running_service(
        make_settings(tmp_path, db_url, make_tls(tmp_path)), pool
    ) as running:

        def send() -> dict[str, tuple[int, bytes]]:
            with smtp_client(running.port("relay")) as client:
                return client.sendmail(
                    "cron@host.internal", ["ops@example.net"], message("cron@host", "ops")
                )

        refused = await asyncio.to_thread(send)
    assert refused == {}
    [row] = await message_rows(pool)
    internal = await pool.fetchval("SELECT id FROM org WHERE name = 'internal'")
    assert row["org_id"] == internal
    assert row["auth_user"] is None and row["credential_id"] is None
    assert b"Authentication-Results: mta.test; auth=none" in bytes(row["body"])


async def test_ehlo_advertises_the_extensions(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    settings = make_settings(tmp_path, db_url, tls, max_message_size=123456)
    async with running_service(settings, pool) as running:

        def ehlo() -> tuple[set[str], set[str], str, tuple[int, bytes]]:
            with smtp_client(running.port("submission")) as client:
                client.ehlo("client.test")
                before = set(client.esmtp_features)
                client.starttls(context=tls.client_context())
                client.ehlo("client.test")
                after = set(client.esmtp_features)
                return before, after, client.esmtp_features["size"], client.docmd("HELP")

        before, after, size, help_reply = await asyncio.to_thread(ehlo)
    expected = {"pipelining", "8bitmime", "smtputf8", "enhancedstatuscodes", "size"}
    assert expected | {"starttls"} <= before
    assert "auth" not in before  # never offered in the clear
    assert expected | {"auth"} <= after and "starttls" not in after
    assert size == "123456"
    assert help_reply[0] == 250
    assert b"AUTH DATA EHLO" in help_reply[1] and b"STARTTLS" in help_reply[1]


async def test_client_headers_are_kept_and_forged_results_removed(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    async with running_service(
        make_settings(tmp_path, db_url, make_tls(tmp_path)), pool
    ) as running:
        raw = (
            b"Authentication-Results: mta.test; auth=pass smtp.auth=ceo\r\n"
            b"Authentication-Results: other.example; spf=pass\r\n"
            b"Message-ID: <own-id@app.example>\r\n"
            b"Date: Mon, 1 Jan 2024 00:00:00 +0000\r\n"
            b"Subject: bare line feeds\r\n\r\nline one\nline two\r\n"
        )

        def send() -> None:
            with smtp_client(running.port("relay")) as client:
                client.ehlo()
                client.mail("a@host.internal")
                client.rcpt("b@example.net")
                code, _ = client.data(raw)
                assert code == 250

        await asyncio.to_thread(send)
    [row] = await message_rows(pool)
    body = bytes(row["body"])
    assert row["header_message_id"] == "own-id@app.example"
    assert body.count(b"Message-ID:") == 1 and body.count(b"\r\nDate:") == 1
    assert b"smtp.auth=ceo" not in body
    assert b"Authentication-Results: other.example; spf=pass\r\n" in body
    assert body.endswith(b"\r\n\r\nline one\r\nline two\r\n")


async def test_the_same_recipient_twice_in_one_envelope_is_queued_once(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    async with running_service(
        make_settings(tmp_path, db_url, make_tls(tmp_path)), pool
    ) as running:

        def send() -> dict[str, tuple[int, bytes]]:
            with smtp_client(running.port("relay")) as client:
                return client.sendmail(
                    "cron@host.internal",
                    ["ops@example.net", "ops@EXAMPLE.net", "other@example.net", "ops@example.net"],
                    message("cron@host", "ops"),
                )

        refused = await asyncio.to_thread(send)
    assert refused == {}
    addresses = [
        r["address"] for r in await pool.fetch("SELECT address FROM recipient ORDER BY address")
    ]
    assert addresses == ["ops@example.net", "other@example.net"]
