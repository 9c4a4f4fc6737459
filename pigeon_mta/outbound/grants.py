"""What a delivery asks of the cluster's budgets and what it gets: the values outbound/budgets.py
hands around (a need per budget, a pass or a wait), and what one process holds of each budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

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
    parked_until: datetime | None = None  # a dead site's next probe
    connections: set[ConnectionKey] = field(default_factory=set)


def name_of(need: Need) -> str:
    """A budget as the log names it: "destination site:...", "lane bulk", "its org"."""
    kind, _, name = need.key.partition(":")
    return f"{kind} {name}" if kind != "org" else "its org"


# Mail handed back for want of a slot is due again this soon at the earliest.
SLOT_RETRY = 0.2


def wait_for(need: Need, held: Held, *, backing_off: bool, slot_free: bool) -> Wait | None:
    """Why a delivery finds no room in this budget, and until when (None: it has room). Mail
    that waits for a destination's tokens (a rate, a backoff, a stated delay, a parked site)
    waits in the site's queue; for a lane's or an org's tokens it is booked a token apart."""
    wall = datetime.now(UTC)
    site = need.key if need.key.startswith(DESTINATION) else None
    if held.parked_until is not None and site is not None and not need.prepaid:
        reason = (
            f"postponed: {name_of(need)} is parked after failed connections; "
            f"a probe is tried at {held.parked_until.astimezone(UTC):%H:%M:%S}, in its site queue"
        )
        return Wait(wall, reason, need, "parked", site)
    if held.held_until is not None and held.held_until > wall:
        reason = (
            f"postponed: {name_of(need)} asked to retry later (a throttling reply); "
            "not counted as an attempt"
        )
        if site is not None:  # its queue is held as long
            return Wait(wall, reason, need, "backoff", site)
        return Wait(spread(held, held.held_until), reason, need, "backoff")
    if held.tokens < 1 and held.effective_rate > 0 and not need.prepaid:
        kind = "backoff" if backing_off else "rate"
        reason = (
            f"postponed: {name_of(need)} is backing off after throttling replies "
            f"(effective rate {held.effective_rate:g}/s)"
            if backing_off
            else f"postponed: waiting for the rate budget of {name_of(need)} "
            f"({held.effective_rate:g}/s)"
        )
        if site is not None:
            # The site's queue: claimed again when the budget has room, untouched till then.
            return Wait(wall, reason + ", in its site queue", need, kind, site)
        return Wait(spread(held, held.booked_from or wall), reason, need, kind)
    if not slot_free:
        # A session ends about every (session time / concurrency); half a second each is what
        # a loaded destination's transactions take.
        per_slot = 0.5 / max(1, held.effective_concurrency or 1)
        held.slot_waits += 1
        until = wall + timedelta(seconds=SLOT_RETRY + held.slot_waits * per_slot)
        reason = (
            f"postponed: waiting for a session slot of {name_of(need)} "
            f"({held.effective_concurrency} at once, cluster-wide)"
        )
        return Wait(until, reason, need, "backoff" if backing_off else "concurrency")
    return None


def spread(held: Held, start: datetime) -> datetime:
    """The next booked time of this budget: a token apart after `start`."""
    rate = held.effective_rate or 1.0
    until = start + timedelta(seconds=held.booked / rate)
    held.booked += 1
    return until
