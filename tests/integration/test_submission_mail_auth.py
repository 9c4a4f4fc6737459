"""MAIL's AUTH= parameter (RFC 4954 section 5), as relaying MTAs send it: accepted, decoded from
xtext (RFC 3461 section 4), recorded in the queued log line, and never used for the sender policy.

smtplib ──STARTTLS + AUTH PLAIN──► submission listener (test CA) ──► PostgreSQL
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import asyncpg
import pytest

from tests.integration.submission_helpers import (
    ServerTLS,
    User,
    add_user,
    make_settings,
    make_tls,
    message,
    message_rows,
    running_service,
    smtp_client,
)


def _session(port: int, tls: ServerTLS, user: User, commands: list[str]) -> list[tuple[int, str]]:
    """Each command's reply, after STARTTLS and AUTH; blocking (run it in a thread)."""
    with smtp_client(port) as client:
        client.starttls(context=tls.client_context())
        client.login(user.username, user.password)
        replies = []
        for command in commands:
            code, text = client.docmd(command)
            replies.append((code, text.decode()))
        return replies


async def test_exims_mail_command_is_accepted_and_its_auth_recorded(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pigeon_mta.submission")
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def send() -> tuple[int, bytes]:
            with smtp_client(running.port("submission")) as client:
                client.starttls(context=tls.client_context())
                client.login(user.username, user.password)
                # Exim 4.96 as a smarthost client, its local user's address xtext-encoded.
                code, text = client.mail("app@acme.example", ["SIZE=1371", "AUTH=Root+2Bcron@Host"])
                assert (code, text) == (250, b"2.1.0 Ok")
                client.rcpt("bob@example.net")
                return client.data(message("app@acme.example", "bob@example.net"))

        code, _ = await asyncio.to_thread(send)
    assert code == 250
    [row] = await message_rows(pool)
    assert row["sender"] == "app@acme.example" and row["auth_user"] == "alice"
    [queued] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("queued ")]
    # Decoded, the case of the mailbox kept (aiosmtpd upper-cases the parameters it parses).
    assert queued.endswith(" auth=<Root+cron@Host>"), queued


async def test_auth_of_the_null_mailbox_and_without_auth_command(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pigeon_mta.submission")
    tls = make_tls(tmp_path)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:

        def send() -> tuple[int, bytes]:
            # A trusted-network client that did not AUTH may still give the parameter.
            with smtp_client(running.port("relay")) as client:
                client.ehlo()
                code, text = client.mail("app@host.internal", ["AUTH=<>", "BODY=8BITMIME"])
                assert (code, text) == (250, b"2.1.0 Ok")
                client.rcpt("bob@example.net")
                return client.data(message("app@host.internal", "bob@example.net"))

        code, _ = await asyncio.to_thread(send)
    assert code == 250
    [queued] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("queued ")]
    assert queued.endswith(" auth=<>"), queued


@pytest.mark.parametrize(
    "param",
    [
        "AUTH",  # no value
        "AUTH=",
        "AUTH=root",  # not an addr-spec
        "AUTH=root@",
        "AUTH=a=b@host.example",  # "=" must be hexchar-encoded
        "AUTH=a+zz@host.example",  # not a hexchar
        "AUTH=a+FF@host.example",  # decodes to an octet that is not UTF-8
        "AUTH=<> AUTH=<>",  # given twice
    ],
)
async def test_a_malformed_auth_parameter_gets_501(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, param: str
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:
        replies = await asyncio.to_thread(
            _session,
            running.port("submission"),
            tls,
            user,
            [f"MAIL FROM:<app@acme.example> {param}", "MAIL FROM:<app@acme.example>"],
        )
    assert replies[0][0] == 501 and replies[0][1].startswith("5.5.4 "), replies
    # The session goes on: the transaction can start afresh.
    assert replies[1] == (250, "2.1.0 Ok")


async def test_the_auth_parameter_is_no_policy_input(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    user = await add_user(pool)
    async with running_service(make_settings(tmp_path, db_url, tls), pool) as running:
        replies = await asyncio.to_thread(
            _session,
            running.port("submission"),
            tls,
            user,
            [
                # Claiming a mailbox of the user's own domain does not let a foreign sender in.
                "MAIL FROM:<boss@other.example> AUTH=app@acme.example",
                # A foreign claim does not stop the user's own sender.
                "MAIL FROM:<app@acme.example> AUTH=boss@other.example",
            ],
        )
    assert replies[0][0] == 553, replies
    assert replies[1] == (250, "2.1.0 Ok")
