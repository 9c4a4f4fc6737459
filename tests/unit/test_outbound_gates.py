"""A destination's per-process gate: its adaptive limit, hand-over of slots, and the cap on the
transactions waiting in the engine. Real asyncio tasks, a fake clock for the controller."""

from __future__ import annotations

import asyncio

from pigeon_mta.config import DeliverySettings
from pigeon_mta.outbound import limits
from pigeon_mta.outbound.limits import Gate, Gates, policy_for
from pigeon_mta.outbound.mx import Hop, Route


def policy(concurrency: int = 50) -> limits.DestinationPolicy:
    delivery = DeliverySettings(destination_concurrency=concurrency)
    return policy_for(
        delivery, "a.example", Route("mx:a.example", "a.example", (Hop("mx.a.example", 25),))
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def enter_all(gates: Gates, n: int, max_wait: float = 0.05) -> list[Gate | float]:
    return list(await asyncio.gather(*(gates.enter(policy(), max_wait) for _ in range(n))))


async def test_an_adaptive_gate_starts_at_its_initial_limit_and_grows_with_healthy_replies() -> (
    None
):
    clock = Clock()
    gates = Gates(initial=10, clock=clock)
    entered = await enter_all(gates, 12)
    admitted = [g for g in entered if isinstance(g, Gate)]
    assert len(admitted) == 10  # two waited past max_wait and were told when to come back
    for gate in admitted:
        clock.now += 0.01
        gates.leave(gate, "healthy", 0.2)
    gate = gates.get(policy())
    assert gate.limit == 20  # slow start: one more per healthy reply
    assert len([g for g in await enter_all(gates, 25) if isinstance(g, Gate)]) == 20


async def test_a_throttling_reply_halves_the_limit_and_a_broken_connection_too() -> None:
    clock = Clock()
    gates = Gates(initial=40, clock=clock)
    gate = await gates.enter(policy(), 1)
    assert isinstance(gate, Gate)
    gates.leave(gate, "throttled", 0.1)
    assert gate.limit == 20
    clock.now += 5
    again = await gates.enter(policy(), 1)
    assert again is gate
    gates.leave(gate, "connection-error", 0.0)
    assert gate.limit == 10


async def test_fixed_limits_when_adaptive_concurrency_is_off() -> None:
    gates = Gates(initial=0)
    gate = gates.get(policy(concurrency=7))
    assert gate.limit == 7
    entered = await asyncio.gather(*(gates.enter(policy(concurrency=7), 0.05) for _ in range(8)))
    assert sum(isinstance(g, Gate) for g in entered) == 7
    for g in entered:
        if isinstance(g, Gate):
            gates.leave(g, "throttled", 0.1)
    assert gate.limit == 7 and gate.in_flight == 0


async def test_a_freed_slot_goes_to_a_waiter_and_a_timed_out_waiter_takes_none() -> None:
    gates = Gates(initial=0)
    p = policy(concurrency=1)
    first = await gates.enter(p, 1)
    assert isinstance(first, Gate)
    timed_out = await gates.enter(p, 0.01)
    assert isinstance(timed_out, float)
    waiter = asyncio.create_task(gates.enter(p, 5))
    await asyncio.sleep(0.01)
    gates.leave(first, "healthy", 0.1)
    second = await waiter
    assert second is first and first.in_flight == 1
    gates.leave(second, None)
    assert first.in_flight == 0 and first.waiting == 0


async def test_a_full_destination_hands_back_at_once_beyond_two_waiting_per_slot() -> None:
    gates = Gates(initial=0)
    p = policy(concurrency=2)
    holders = [await gates.enter(p, 1) for _ in range(2)]
    waiters = [asyncio.create_task(gates.enter(p, 5)) for _ in range(4)]
    await asyncio.sleep(0.01)
    handed_back = await gates.enter(p, 5)
    assert isinstance(handed_back, float)  # told when to come back, without joining the wait
    assert gates.get(p).waiting == 4
    for holder in holders:
        assert isinstance(holder, Gate)
        gates.leave(holder, "healthy", 0.1)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_waiter_cancelled_while_waiting_takes_no_slot() -> None:
    gates = Gates(initial=0)
    p = policy(concurrency=1)
    first = await gates.enter(p, 1)
    assert isinstance(first, Gate)
    waiter = asyncio.create_task(gates.enter(p, 30))
    await asyncio.sleep(0.01)
    waiter.cancel()  # as the engine cancels deliveries that have not started when it stops
    await asyncio.gather(waiter, return_exceptions=True)
    gates.leave(first, "healthy", 0.1)
    assert first.in_flight == 0 and first.waiting == 0
    again = await gates.enter(p, 1)
    assert again is first and first.in_flight == 1


async def test_a_slot_handed_to_a_waiter_cancelled_in_the_same_moment_goes_back() -> None:
    gates = Gates(initial=0)
    p = policy(concurrency=1)
    first = await gates.enter(p, 1)
    assert isinstance(first, Gate)
    waiter = asyncio.create_task(gates.enter(p, 30))
    await asyncio.sleep(0.01)
    gates.leave(first, "healthy", 0.1)  # hands the slot to the waiter ...
    waiter.cancel()  # ... which is cancelled before it runs again
    await asyncio.gather(waiter, return_exceptions=True)
    assert first.in_flight == 0
