"""The adaptive concurrency controller: sequences of replies in, the destination's limit out."""

from __future__ import annotations

import pytest

from pigeon_mta.outbound.adaptive import (
    AimdPolicy,
    AimdState,
    after_connection_error,
    after_healthy_reply,
    after_throttling,
    start,
)

# An event: ("ok", now, seconds the transaction took), ("throttled", now) or ("refused", now) for
# a connection error.
Event = tuple[str, float] | tuple[str, float, float]


def replay(policy: AimdPolicy, events: list[Event]) -> AimdState:
    state = start(policy)
    for event in events:
        if event[0] == "ok":
            assert len(event) == 3
            state = after_healthy_reply(state, policy, event[1], event[2])
        elif event[0] == "throttled":
            state = after_throttling(state, policy, event[1])
        else:
            state = after_connection_error(state, policy, event[1])
    return state


def fast(count: int, at: float = 0.0, seconds: float = 0.1) -> list[Event]:
    return [("ok", at + i * 0.001, seconds) for i in range(count)]


@pytest.mark.parametrize(
    ("name", "policy", "events", "expected"),
    [
        ("starts at initial", AimdPolicy(maximum=200), [], 10),
        ("slow start doubles in one round", AimdPolicy(maximum=200), fast(10), 20),
        ("slow start stops at the maximum", AimdPolicy(maximum=50), fast(500), 50),
        ("a maximum of one stays at one", AimdPolicy(maximum=1, initial=1), fast(100), 1),
        ("throttling halves", AimdPolicy(maximum=200), [*fast(30), ("throttled", 1.0)], 20),
        ("a refused connection halves", AimdPolicy(maximum=200), [*fast(30), ("refused", 1.0)], 20),
        (
            "a burst of push-back within the interval halves once",
            AimdPolicy(maximum=200),
            [*fast(30), *[("throttled", 1.0 + i * 0.01) for i in range(50)]],
            20,
        ),
        (
            "push-back after the interval halves again",
            AimdPolicy(maximum=200),
            [*fast(30), ("throttled", 1.0), ("throttled", 2.5)],
            10,
        ),
        (
            "never below one",
            AimdPolicy(maximum=200),
            [("refused", float(t)) for t in range(20)],
            1,
        ),
        (
            "after push-back, one more per round of fast replies",
            AimdPolicy(maximum=200),
            [*fast(10), ("throttled", 1.0), *fast(10, at=2.0), *fast(13, at=3.0)],
            12,
        ),
        (
            "slow replies hold the limit",
            AimdPolicy(maximum=200),
            [*fast(5), *fast(20, at=1.0, seconds=1.2)],
            15,
        ),
        (
            # Beyond twice the slow bound (0.1 * 2 + 0.5 = 0.7 s): overloaded, one fewer a round.
            "replies far slower than the baseline shrink the limit a session a round",
            AimdPolicy(maximum=200),
            [*fast(5), *fast(15, at=1.0, seconds=1.5), *fast(14, at=3.0, seconds=3.0)],
            12,  # two rounds of such replies: 15 -> 12.9
        ),
        (
            "never below one by slow replies",
            AimdPolicy(maximum=200, initial=2),
            [*fast(1), *fast(50, at=1.0, seconds=30.0)],
            1,
        ),
        (
            "replies a little slower than the fastest, in absolute terms, still count as fast",
            AimdPolicy(maximum=200),
            [*fast(5, seconds=0.002), *fast(5, at=1.0, seconds=0.3)],
            20,
        ),
        (
            "a reply within the slow factor still counts as fast",
            AimdPolicy(maximum=200),
            [*fast(5), *fast(5, at=1.0, seconds=0.2)],
            20,
        ),
        (
            "the baseline ages out, so a slower route grows again",
            AimdPolicy(maximum=200, baseline_window=60),
            [*fast(5), *fast(5, at=10.0, seconds=1.2), *fast(5, at=100.0, seconds=1.2)],
            20,
        ),
    ],
)
def test_limit_after_a_sequence_of_replies(
    name: str, policy: AimdPolicy, events: list[Event], expected: int
) -> None:
    assert replay(policy, events).concurrency == expected, name


def test_growth_from_one_reaches_the_maximum_and_stays_there() -> None:
    policy = AimdPolicy(maximum=500, initial=1)
    state = replay(policy, [*fast(5), ("throttled", 1.0)])
    rounds = 0
    while state.concurrency < policy.maximum and rounds < 10_000:
        state = replay_onto(state, policy, fast(state.concurrency, at=2.0 + rounds))
        rounds += 1
    assert state.concurrency == policy.maximum
    assert replay_onto(state, policy, fast(1000, at=20_000.0)).concurrency == policy.maximum


def replay_onto(state: AimdState, policy: AimdPolicy, events: list[Event]) -> AimdState:
    for event in events:
        assert event[0] == "ok" and len(event) == 3
        state = after_healthy_reply(state, policy, event[1], event[2])
    return state


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"maximum": 0}, "maximum must be at least 1"),
        ({"maximum": 5, "initial": 6}, "initial must be between 1 and maximum"),
        ({"maximum": 5, "initial": 0}, "initial must be between 1 and maximum"),
        ({"maximum": 5, "initial": 1, "decrease_factor": 1.0}, "decrease_factor"),
        ({"maximum": 5, "initial": 1, "decrease_factor": 0.0}, "decrease_factor"),
        ({"maximum": 5, "initial": 1, "slow_reply_factor": 0.5}, "slow_reply_factor"),
        ({"maximum": 5, "initial": 1, "baseline_window": 0}, "baseline_window"),
    ],
)
def test_policy_refuses_values_that_break_the_bounds(
    settings: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        AimdPolicy(**settings)  # type: ignore[arg-type]
