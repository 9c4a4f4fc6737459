"""The API's memory of yes-answers (memo.py): what it keeps, for how long, and that waiters
share one look-up and never keep a failed one."""

from __future__ import annotations

import asyncio

import pytest

from pigeon_mta.memo import Memo


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Lookups:
    def __init__(self, answer: object = True) -> None:
        self.answer = answer
        self.calls = 0
        self.release = asyncio.Event()
        self.release.set()
        self.fail: Exception | None = None

    async def __call__(self) -> object:
        self.calls += 1
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return self.answer


async def test_a_yes_is_kept_for_the_ttl_and_a_no_is_not_kept() -> None:
    clock = Clock()
    memo: Memo[str, object] = Memo(1.0, clock=clock)
    yes = Lookups(True)
    assert await memo.get("k", yes) is True
    clock.now = 0.99
    assert await memo.get("k", yes) is True
    assert yes.calls == 1
    clock.now = 1.0
    assert await memo.get("k", yes) is True
    assert yes.calls == 2

    no = Lookups(None)
    assert await memo.get("n", no) is None
    assert await memo.get("n", no) is None
    assert no.calls == 2


async def test_without_a_ttl_every_get_looks_up() -> None:
    memo: Memo[str, object] = Memo(0)
    lookups = Lookups(True)
    for _ in range(3):
        assert await memo.get("k", lookups) is True
    assert lookups.calls == 3


async def test_concurrent_gets_share_one_lookup_and_a_failure_is_not_kept() -> None:
    memo: Memo[str, object] = Memo(60)
    lookups = Lookups(True)
    lookups.release.clear()
    lookups.fail = ConnectionError("database away")
    waiters = [asyncio.ensure_future(memo.get("k", lookups)) for _ in range(5)]
    await asyncio.sleep(0)
    lookups.release.set()
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert lookups.calls == 1
    assert all(isinstance(o, ConnectionError) for o in outcomes)

    lookups.fail = None
    assert await memo.get("k", lookups) is True
    assert lookups.calls == 2


async def test_a_cancelled_waiter_does_not_cancel_the_lookup_of_the_others() -> None:
    memo: Memo[str, object] = Memo(60)
    lookups = Lookups("yes")
    lookups.release.clear()
    first = asyncio.ensure_future(memo.get("k", lookups))
    second = asyncio.ensure_future(memo.get("k", lookups))
    await asyncio.sleep(0)
    first.cancel()
    lookups.release.set()
    assert await second == "yes"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert lookups.calls == 1


async def test_past_its_size_the_memory_starts_afresh() -> None:
    memo: Memo[int, object] = Memo(60, max_entries=3)
    lookups = Lookups(True)
    for key in range(4):
        await memo.get(key, lookups)
    assert lookups.calls == 4
    await memo.get(3, lookups)  # kept after the fresh start
    await memo.get(0, lookups)  # forgotten by it
    assert lookups.calls == 5
