"""What a delivery asks of the cluster's budgets and what it gets: the values outbound/budgets.py
hands around (a need per budget, a pass or a wait), and what one process holds of each budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from pigeon_mta.outbound.connect import ConnectionKey
from pigeon_mta.store.budgets import DESTINATION


@dataclass(frozen=True)
class Need:
    """One budget a delivery falls under."""

    key: str
    rate: float
    concurrency: int
    burst: float
    slot: bool  # a session slot too (a destination with a concurrency, or backing off)
    label: str  # the metric label: bounded (configured names only)
    # Its token was taken by the claim (the delivery came from this site's queue).
    prepaid: bool = False


@dataclass(frozen=True)
class Pass:
    """A delivery's grants: a token of each need, a slot of those that take one."""

    needs: tuple[Need, ...]

    @property
    def destination(self) -> bool:
        return any(n.key.startswith(DESTINATION) for n in self.needs)


@dataclass(frozen=True)
class Wait:
    """No room: due again at `until`, with the reason the recipient's log shows."""

    until: datetime
    reason: str
    need: Need
    kind: str  # rate | concurrency | backoff | unavailable
    # The site queue to wait in (a destination budget's key) instead of until `until`.
    site: str | None = None


@dataclass
class Held:
    """What this process holds of one budget."""

    tokens: int = 0
    tokens_until: float = 0.0
    slots: int = 0
    slots_limited: bool = True  # false while the budget has no concurrency in force
    in_use: int = 0
    last_used: float = 0.0
    effective_rate: float = 0.0
    effective_concurrency: int = 0
    booked_from: datetime | None = None
    booked: int = 0  # handed back since booked_from
    slot_waits: int = 0  # handed back for want of a slot since the last grant
    held_until: datetime | None = None
    connections: set[ConnectionKey] = field(default_factory=set)


def name_of(need: Need) -> str:
    """A budget as the log names it: "destination site:...", "lane bulk", "its org"."""
    kind, _, name = need.key.partition(":")
    return f"{kind} {name}" if kind != "org" else "its org"
