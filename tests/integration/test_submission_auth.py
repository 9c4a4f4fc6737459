"""SMTP AUTH: only over TLS (unless configured on loopback), wrong and disabled users, throttling.

client (127.0.0.1 / 127.0.0.3) ──SMTP──► listeners ──► PostgreSQL (credential, auth_throttle)
"""

from __future__ import annotations

import asyncio
import base64
import smtplib
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.metrics import AUTH_FAILURES
from pigeon_mta.store import credentials as store_credentials
from tests.integration.submission_helpers import (
    add_user,
    make_settings,
    make_tls,
    message,
    message_rows,
    running_service,
    smtp_client,
)


def plain(username: str, password: str) -> str:
    return base64.b64encode(f"\0{username}\0{password}".encode()).decode()


async def test_auth_before_starttls_is_refused(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def attempt(listener: str) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
            with smtp_client(running.port(listener)) as client:
                client.ehlo()
                auth = client.docmd("AUTH", "PLAIN " + plain(user.username, user.password))
                mail = client.docmd("MAIL", "FROM:<app@acme.example>")
                return auth, mail

        submission_auth, submission_mail = await asyncio.to_thread(attempt, "submission")
        relay_auth, _ = await asyncio.to_thread(attempt, "relay")
    # Submission (RFC 6409 + 3207): nothing but EHLO/STARTTLS/NOOP/QUIT before TLS.
    assert submission_auth == (530, b"5.7.0 Must issue a STARTTLS command first")
    assert submission_mail[0] == 530
    # Relay listener: STARTTLS is optional there, but AUTH still needs it.
    assert relay_auth[0] == 538 and relay_auth[1].startswith(b"5.7.11")
    assert await message_rows(pool) == []


async def test_plaintext_auth_only_when_configured_on_loopback(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    user = await add_user(pool)
    settings = make_settings(
        tmp_path, db_url, make_tls(tmp_path), modes=("submission",), plaintext_auth=True
    )
    async with running_service(settings, pool) as running:

        def send() -> dict[str, tuple[int, bytes]]:
            with smtp_client(running.port("submission")) as client:
                client.login(user.username, user.password)
                return client.sendmail(
                    "app@acme.example", ["bob@example.net"], message("app@acme.example", "bob")
                )

        assert await asyncio.to_thread(send) == {}
    [row] = await message_rows(pool)
    assert row["auth_user"] == "alice"
    assert b"with ESMTPA id" in bytes(row["body"])  # no S: no TLS


async def test_wrong_password_gets_535_and_is_counted(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    before = AUTH_FAILURES.labels(listener="submissions")._value.get()
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def attempt() -> tuple[int, bytes]:
            with smtplib.SMTP_SSL(
                "127.0.0.1", running.port("submissions"), context=tls.client_context(), timeout=30
            ) as client:
                client.ehlo()
                return client.docmd("AUTH", "PLAIN " + plain(user.username, "wrong"))

        assert await asyncio.to_thread(attempt) == (
            535,
            b"5.7.8 Authentication credentials invalid",
        )
    assert AUTH_FAILURES.labels(listener="submissions")._value.get() == before + 1
    assert await pool.fetchval("SELECT count(*) FROM auth_failure") == 1


async def test_disabled_and_unknown_users_are_refused(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def login(username: str) -> tuple[int, bytes]:
            with smtplib.SMTP_SSL(
                "127.0.0.1", running.port("submissions"), context=tls.client_context(), timeout=30
            ) as client:
                client.ehlo()
                return client.docmd("AUTH", "PLAIN " + plain(username, user.password))

        assert (await asyncio.to_thread(login, "alice"))[0] == 235
        await store_credentials.disable_credential(pool, "alice")
        # The same password was verified a moment ago (and is cached): the row still decides.
        assert (await asyncio.to_thread(login, "alice"))[0] == 535
        assert (await asyncio.to_thread(login, "nobody"))[0] == 535


async def test_repeated_failures_throttle_the_client_ip(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    settings = make_settings(tmp_path, db_url, tls, max_auth_failures=3)
    async with running_service(settings, pool) as running:

        def login(password: str, source: str) -> tuple[int, bytes]:
            with smtp_client(running.port("submission"), source=source) as client:
                client.starttls(context=tls.client_context())
                client.ehlo()
                return client.docmd("AUTH", "PLAIN " + plain(user.username, password))

        for _ in range(3):
            assert (await asyncio.to_thread(login, "guess", "127.0.0.1"))[0] == 535
        # Even the right password is refused now, with a temporary code.
        assert await asyncio.to_thread(login, user.password, "127.0.0.1") == (
            454,
            b"4.7.0 Too many failed authentication attempts, try again later",
        )
        # Another client is not affected.
        assert (await asyncio.to_thread(login, user.password, "127.0.0.3"))[0] == 235
        # Old failures age out of the window, and then the client may try again.
        await pool.execute(
            "UPDATE auth_throttle SET window_start = window_start - interval '1 hour'"
        )
        assert (await asyncio.to_thread(login, user.password, "127.0.0.1"))[0] == 235


@pytest.mark.parametrize("listener", ["submission", "submissions"])
async def test_mail_without_auth_is_refused_on_submission_listeners(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, listener: str
) -> None:
    tls = make_tls(tmp_path)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def attempt() -> tuple[int, bytes]:
            if listener == "submissions":
                client: smtplib.SMTP = smtplib.SMTP_SSL(
                    "127.0.0.1", running.port(listener), context=tls.client_context(), timeout=30
                )
            else:
                client = smtp_client(running.port(listener))
                client.starttls(context=tls.client_context())
            with client:
                client.ehlo()
                return client.docmd("MAIL", "FROM:<app@acme.example>")

        assert await asyncio.to_thread(attempt) == (530, b"5.7.0 Authentication required")


async def test_auth_finds_a_user_by_the_normal_form_of_its_name(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """`user add` refuses names that differ only by case (or are look-alikes from another script),
    so AUTH treats such spellings as the name they normalize to: any case logs in as alice, a
    Cyrillic look-alike does not."""
    user = await add_user(pool)
    settings = make_settings(
        tmp_path, db_url, make_tls(tmp_path), modes=("submission",), plaintext_auth=True
    )
    async with running_service(settings, pool) as running:

        def login(username: str) -> tuple[int, bytes]:
            with smtp_client(running.port("submission")) as client:
                client.ehlo()
                return client.docmd("AUTH", "PLAIN " + plain(username, user.password))

        assert (await asyncio.to_thread(login, "ALICE"))[0] == 235
        assert (await asyncio.to_thread(login, "\u0430lice"))[0] == 535
