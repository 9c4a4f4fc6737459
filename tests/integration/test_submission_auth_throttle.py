"""SMTP AUTH under attack: parallel guesses from one IP, and the same password work for every login.

clients (127.0.0.1, many at once) ──SMTP AUTH──► submission listener ──► PostgreSQL
(credential, auth_throttle, auth_failure)
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from pigeon_mta.store import credentials as store_credentials
from tests.integration.submission_helpers import (
    add_user,
    make_settings,
    make_tls,
    running_service,
    smtp_client,
)

PARALLEL = 40


def plain(username: str, password: str) -> str:
    return base64.b64encode(f"\0{username}\0{password}".encode()).decode()


async def test_parallel_wrong_passwords_are_throttled_after_the_limit(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """The failure count is taken by one statement per failure: of 40 wrong passwords sent at
    once, exactly max_auth_failures get 535 and the rest 454, however their checks interleave."""
    user = await add_user(pool)
    settings = make_settings(
        tmp_path,
        db_url,
        make_tls(tmp_path),
        modes=("submission",),
        plaintext_auth=True,
        max_auth_failures=5,
    )
    async with running_service(settings, pool) as running:
        ready = threading.Barrier(PARALLEL, timeout=60)

        def guess(number: int) -> int:
            with smtp_client(running.port("submission")) as client:
                client.ehlo()
                ready.wait()  # every client is connected: the AUTHs go out together
                code, _ = client.docmd("AUTH", "PLAIN " + plain(user.username, f"guess {number}"))
                return code

        # Threads of their own: the server's scrypt checks use the loop's default executor.
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as clients:
            codes = await asyncio.gather(
                *(loop.run_in_executor(clients, guess, n) for n in range(PARALLEL))
            )
    assert collections.Counter(codes) == {535: 5, 454: PARALLEL - 5}
    assert await pool.fetchval("SELECT count(*) FROM auth_failure") == PARALLEL


async def test_a_right_password_checked_while_the_limit_is_reached_gets_454(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    """An AUTH that began before the IP reached its limit and whose password is checked after it
    did is refused too: otherwise a burst of guesses would tell which one was right."""
    user = await add_user(pool)
    settings = make_settings(
        tmp_path,
        db_url,
        make_tls(tmp_path),
        modes=("submission",),
        plaintext_auth=True,
        max_auth_failures=3,
    )
    async with running_service(settings, pool) as running:

        def attempt() -> list[tuple[int, bytes]]:
            with smtp_client(running.port("submission")) as early:
                early.ehlo()
                # AUTH LOGIN asks for the username and password after the command: this AUTH is
                # under way while the other connection uses up the limit.
                started = early.docmd("AUTH", "LOGIN")
                for n in range(3):
                    with smtp_client(running.port("submission")) as other:
                        other.ehlo()
                        other.docmd("AUTH", "PLAIN " + plain(user.username, f"guess {n}"))
                asked = early.docmd(base64.b64encode(user.username.encode()).decode())
                answer = early.docmd(base64.b64encode(user.password.encode()).decode())
                return [started, asked, answer]

        started, asked, answer = await asyncio.to_thread(attempt)
    assert started[0] == 334 and asked[0] == 334
    assert answer == (454, b"4.7.0 Too many failed authentication attempts, try again later")


async def test_every_refused_login_costs_the_same_password_work(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unknown user, wrong password, disabled user, the right password of a disabled user: each
    runs one scrypt check, so that the time of the reply does not tell them apart."""
    checks: list[str] = []
    real_verify: Callable[[str, str], bool] = store_credentials.verify_password

    def counting_verify(password: str, encoded: str) -> bool:
        checks.append(password)
        return real_verify(password, encoded)

    monkeypatch.setattr(store_credentials, "verify_password", counting_verify)
    user = await add_user(pool)
    settings = make_settings(
        tmp_path,
        db_url,
        make_tls(tmp_path),
        modes=("submission",),
        plaintext_auth=True,
        max_auth_failures=0,
    )
    async with running_service(settings, pool) as running:

        def login(username: str, password: str) -> int:
            with smtp_client(running.port("submission")) as client:
                client.ehlo()
                code, _ = client.docmd("AUTH", "PLAIN " + plain(username, password))
                return code

        assert await asyncio.to_thread(login, "alice", user.password) == 235
        checks.clear()
        assert await asyncio.to_thread(login, "nobody", "pw unknown") == 535
        assert await asyncio.to_thread(login, "alice", "pw wrong") == 535
        await store_credentials.disable_credential(pool, "alice")
        assert await asyncio.to_thread(login, "alice", "pw disabled") == 535
        # Verified (and remembered) a moment ago while enabled: still the full check.
        assert await asyncio.to_thread(login, "alice", user.password) == 535
    assert checks == ["pw unknown", "pw wrong", "pw disabled", user.password]


async def test_the_count_starts_over_after_its_window_and_old_counts_are_pruned(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    user = await add_user(pool)
    settings = make_settings(
        tmp_path,
        db_url,
        make_tls(tmp_path),
        modes=("submission",),
        plaintext_auth=True,
        max_auth_failures=2,
    )
    async with running_service(settings, pool) as running:

        def guess(source: str) -> int:
            with smtp_client(running.port("submission"), source=source) as client:
                client.ehlo()
                code, _ = client.docmd("AUTH", "PLAIN " + plain(user.username, "guess"))
                return code

        assert [await asyncio.to_thread(guess, "127.0.0.1") for _ in range(3)] == [535, 535, 454]
        assert await asyncio.to_thread(guess, "127.0.0.3") == 535
        await pool.execute(
            "UPDATE auth_throttle SET window_start = window_start - interval '1 hour'"
            " WHERE client_ip = '127.0.0.3'"
        )
        await pool.execute(
            "UPDATE auth_throttle SET window_start = window_start - interval '1 hour'"
            " WHERE client_ip = '127.0.0.1'"
        )
        # 127.0.0.1's window has passed: its next failure is the first of a new one. The
        # statement that counts it prunes the passed count of 127.0.0.3.
        assert await asyncio.to_thread(guess, "127.0.0.1") == 535
    rows = await pool.fetch("SELECT host(client_ip) AS ip, failures FROM auth_throttle")
    assert [(r["ip"], r["failures"]) for r in rows] == [("127.0.0.1", 1)]
