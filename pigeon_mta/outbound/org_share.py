"""Each org's share of one engine's slots (`delivery.max_org_share`): the deliveries it holds and
the recipients reserved for it, the room the claim may still give it, and the wake-up of a claim
that left a capped org's due mail behind once that org has a few slots again."""

from __future__ import annotations

import asyncio
import collections
import uuid


class OrgShare:
    def __init__(self, concurrency: int, share: float, bite: int) -> None:
        self.cap = max(1, int(concurrency * share))
        self._step = max(1, bite // 4)
        self._held: collections.Counter[uuid.UUID] = collections.Counter()
        self._reserved: collections.Counter[uuid.UUID] = collections.Counter()
        # Set when an org at its cap is a few slots below it again.
        self.room = asyncio.Event()

    def taken(self, org_id: uuid.UUID) -> int:
        """The slots an org holds or has reserved."""
        return self._held.get(org_id, 0) + self._reserved.get(org_id, 0)

    def fits(self, org_id: uuid.UUID, n: int) -> bool:
        return self.taken(org_id) + n <= self.cap

    def reserve(self, org_id: uuid.UUID, n: int) -> None:
        self._reserved[org_id] += n

    def unreserve(self, org_id: uuid.UUID, n: int) -> None:
        self._reserved[org_id] -= n
        if self._reserved[org_id] <= 0:
            del self._reserved[org_id]
        self._freed(org_id, n)

    def started(self, org_id: uuid.UUID) -> None:
        self._held[org_id] += 1

    def done(self, org_id: uuid.UUID) -> None:
        self._held[org_id] -= 1
        if self._held[org_id] <= 0:
            del self._held[org_id]
        self._freed(org_id, 1)

    def rooms(self) -> dict[uuid.UUID, int]:
        """What the claim may still give each org the engine holds or reserves something of (an
        org not named gets at most `cap`)."""
        return {o: self.cap - self.taken(o) for o in self._held.keys() | self._reserved.keys()}

    def limited(self, rooms: dict[uuid.UUID, int], want: int) -> bool:
        """Whether a claim of `want` with these rooms may have been cut short by an org's room."""
        return self.cap < want or any(n < want for n in rooms.values())

    def capped(self) -> bool:
        """Whether an org holds its whole share (its due mail, if any, was left)."""
        return any(n >= self.cap for n in self._held.values())

    def _freed(self, org_id: uuid.UUID, n: int) -> None:
        """Wake a claim waiting for room of a capped org once the org is a few slots below its
        cap (not at every one)."""
        now = self.taken(org_id)
        mark = max(0, self.cap - self._step)
        if now <= mark < now + n:
            self.room.set()
