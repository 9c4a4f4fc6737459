"""The one retry timing of mail and of webhook events: exponential backoff with jitter."""

from __future__ import annotations

import random


def backoff_window(attempts: int, initial: float, maximum: float) -> tuple[float, float]:
    """The range the delay before the next try falls in, after `attempts` tries.

    Exponential: initial, 2x, 4x ... capped at maximum; jitter spreads the next tries of mail
    that failed together (a destination that was down) over a quarter of the step, so they do
    not all come back at the same moment.
    """
    exponent = max(0, min(attempts - 1, 60))
    base = min(maximum, initial * (2.0**exponent))
    return max(initial, base * 0.75) if attempts > 1 else initial, min(maximum, base * 1.25)


def backoff_delay(
    attempts: int, initial: float, maximum: float, rng: random.Random | None = None
) -> float:
    """A delay drawn from `backoff_window`."""
    low, high = backoff_window(attempts, initial, maximum)
    return (rng or random).uniform(low, high)
