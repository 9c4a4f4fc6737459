"""How many transactions one destination gets at once: additive increase, multiplicative decrease.

Postfix adapts a destination's concurrency to how it answers (its `*_destination_concurrency_*`
feedback); this controller does the same with TCP's arithmetic and ceilings an asyncio engine can
afford. While replies come back fast and healthy the limit grows, by one per healthy reply at first
(doubling every round of transactions, TCP's slow start) and by one per round once the destination
has pushed back (congestion avoidance). A throttling reply (`421 4.7.0 Try again later`, Gmail's
4.7.28...) or a failed connection multiplies the limit by `decrease_factor`, once per
`decrease_interval`: the transactions already in flight when a destination starts to push back all
report it, and they are one signal, not a hundred. The limit stays within [1, `maximum`].

A reply counts as fast when it took at most `slow_reply_factor` times the fastest reply of the last
`baseline_window`, plus `slow_reply_slack` seconds: a destination whose replies slow down is busy,
so the limit holds rather than grows; one whose replies take more than twice that is overloaded,
and each such reply takes 1/limit off the limit (one session fewer per round of them). The slack keeps a near destination (a LAN relay answering in
milliseconds) growing while its replies vary with this machine's own load by tens of milliseconds,
which says nothing about the destination. The baseline ages out because a route can change for good (a new MX, a longer path).

Pure: state in, state out, the clock passed in by the caller. Which replies are throttling and
which are healthy is `classify`'s to say, not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AimdPolicy:
    """The constants of one destination's controller."""

    # The configured ceiling (the destination's concurrency): the limit never exceeds it.
    maximum: int
    # The limit a destination starts with, before anything is known about it.
    initial: int = 10
    # What a throttling reply or a connection error multiplies the limit by.
    decrease_factor: float = 0.5
    # Signals within this many seconds of a decrease are the same push-back and decrease nothing.
    decrease_interval: float = 1.0
    # A reply slower than this many times the baseline (the fastest recent one) is not fast.
    slow_reply_factor: float = 2.0
    # Seconds a reply may take beyond that and still count as fast.
    slow_reply_slack: float = 0.5
    # Seconds the fastest reply stays the baseline before the next healthy reply replaces it.
    baseline_window: float = 60.0

    def __post_init__(self) -> None:
        if self.maximum < 1:
            raise ValueError("maximum must be at least 1")
        if not 1 <= self.initial <= self.maximum:
            raise ValueError("initial must be between 1 and maximum")
        if not 0 < self.decrease_factor < 1:
            raise ValueError("decrease_factor must be between 0 and 1")
        if self.decrease_interval < 0 or self.baseline_window <= 0:
            raise ValueError("decrease_interval and baseline_window must not be negative")
        if self.slow_reply_factor < 1:
            raise ValueError("slow_reply_factor must be at least 1")


@dataclass(frozen=True)
class AimdState:
    """One destination's limit and what the controller remembers about its replies."""

    # Fractional, so that congestion avoidance can add 1/limit per reply.
    limit: float
    # True until the destination first pushes back.
    slow_start: bool = True
    # The baseline: the fastest healthy reply (seconds) since `baseline_since`.
    fastest: float = math.inf
    baseline_since: float = -math.inf
    decreased_at: float = -math.inf

    @property
    def concurrency(self) -> int:
        """Transactions the destination may have in flight at once."""
        return max(1, math.floor(self.limit))


def start(policy: AimdPolicy) -> AimdState:
    return AimdState(limit=float(policy.initial))


def after_healthy_reply(
    state: AimdState, policy: AimdPolicy, now: float, seconds: float
) -> AimdState:
    """A transaction ended with a reply that was not throttling, `seconds` after it began."""
    if now - state.baseline_since > policy.baseline_window or seconds < state.fastest:
        state = replace(state, fastest=seconds, baseline_since=now)
    slow = state.fastest * policy.slow_reply_factor + policy.slow_reply_slack
    if seconds > 2 * slow:
        # Far slower than its baseline: the destination is overloaded, and more sessions would
        # only hold more of the engine's slots. One fewer per round of such replies.
        return replace(state, limit=max(1.0, state.limit - 1.0 / state.limit), slow_start=False)
    if seconds > slow:
        return state
    step = 1.0 if state.slow_start else 1.0 / state.limit
    return replace(state, limit=min(float(policy.maximum), state.limit + step))


def after_throttling(state: AimdState, policy: AimdPolicy, now: float) -> AimdState:
    """The destination answered with a throttling (rate-limited) reply."""
    return _back_off(state, policy, now)


def after_connection_error(state: AimdState, policy: AimdPolicy, now: float) -> AimdState:
    """A connection to the destination failed or timed out, or it dropped one mid-transaction."""
    return _back_off(state, policy, now)


def _back_off(state: AimdState, policy: AimdPolicy, now: float) -> AimdState:
    if now - state.decreased_at < policy.decrease_interval:
        return replace(state, slow_start=False)
    return replace(
        state,
        limit=max(1.0, state.limit * policy.decrease_factor),
        slow_start=False,
        decreased_at=now,
    )
