"""The engine's claims: claimed rows grouped into deliveries, and the ledger of those not recorded.

A claim holds a recipient under a lease (store/leases.py: the attempt number is its fencing token).
The ledger keeps every claim this engine holds until its outcome is recorded, renews the leases of
long transactions so that no other worker takes their recipients meanwhile, and hands claims back
to the queue unattempted: a claim round's postponements in one statement, all of them at stop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from pigeon_mta.model import AttemptResult, ClaimedRecipient, ClaimedRow, Delivery
from pigeon_mta.store import leases as store_leases
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger(__name__)


def each_domain(domain: str) -> str:
    """The default destination of a domain: the domain itself."""
    return domain


def group_deliveries(
    rows: Sequence[ClaimedRow], destination: Callable[[str], str] = each_domain
) -> list[Delivery]:
    """One Delivery per (message, destination of its domain), in the order the messages were
    received, each one's recipients in address (code point) order. The engine's `destination`
    makes recipients of one message at domains that share a static route or the relayhost travel
    together; by default each domain is a destination of its own."""
    bodies = {row.queue_id: row.body for row in rows if row.body is not None}
    # Rows from a site's queue (their token taken by the claim) and rows without one never share
    # a delivery: each pays its own way through the budgets.
    groups: dict[tuple[uuid.UUID, str, str | None], list[ClaimedRow]] = {}
    for row in rows:
        groups.setdefault((row.queue_id, destination(row.domain), row.site), []).append(row)
    deliveries = []
    for (queue_id, _destination, _site), members in groups.items():
        members.sort(key=lambda row: row.recipient.address)
        first = members[0]
        deliveries.append(
            Delivery(
                queue_id=queue_id,
                org_id=first.org_id,
                sender=first.sender,
                domain=first.domain,
                header_message_id=first.header_message_id,
                received_at=first.received_at,
                body=bodies[queue_id],
                recipients=tuple(row.recipient for row in members),
                lane=first.lane,
                site=first.site,
                site_delay=max(row.site_delay for row in members),
                expires_at=first.expires_at,
            )
        )
    deliveries.sort(key=lambda d: (d.received_at, d.queue_id))
    return deliveries


@dataclass
class _Held:
    """A claimed recipient not yet recorded."""

    delivery: Delivery
    recipient: ClaimedRecipient
    renewed_at: float


@dataclass
class _Postponing:
    """A claim being handed back unattempted (see `Claims.postpone`)."""

    recipient: ClaimedRecipient
    due_at: datetime
    reason: str | None
    site: str | None
    done: asyncio.Future[None]
    # The delivery's (org, lane, domain): with a site, its group's other due rows to that
    # domain join the site's queue too.
    group: tuple[uuid.UUID, str, str] | None = None


class Claims:
    """The recipients one engine holds under `owner`'s lease, until their outcome is recorded."""

    def __init__(self, pool: asyncpg.Pool, *, owner: str, lease: float) -> None:
        self.pool = pool
        self.owner = owner
        self.lease = lease
        self._held: dict[uuid.UUID, _Held] = {}
        # Claims whose whole message went out and whose transaction has no result yet.
        self._sent: set[uuid.UUID] = set()
        # Postponed claims waiting for their batch's statement (see `postpone`).
        self._postponing: list[_Postponing] = []
        self._postponer: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, deliveries: Sequence[Delivery], now: float) -> None:
        """Enter freshly claimed deliveries (`now` on the event loop's clock)."""
        for d in deliveries:
            for r in d.recipients:
                self._held[r.id] = _Held(d, r, now)

    def mark_sent(self, ids: Iterable[uuid.UUID]) -> None:
        """The whole message went out to these; their final reply is still to come."""
        self._sent.update(ids)

    def judged(self, results: Sequence[AttemptResult]) -> None:
        """These claims have their results (to be recorded)."""
        for result in results:
            self._sent.discard(result.recipient_id)

    def sent_unjudged(self) -> list[tuple[Delivery, ClaimedRecipient]]:
        """Claims whose message went out and whose transaction was broken off before it ended:
        the peer may have delivered it."""
        return [(h.delivery, h.recipient) for rid, h in self._held.items() if rid in self._sent]

    def delivery_of(self, recipient_id: uuid.UUID) -> Delivery | None:
        held = self._held.get(recipient_id)
        return held.delivery if held is not None else None

    def forget(self, result: AttemptResult) -> None:
        """Drop the claim a recorded result belonged to; not a newer claim of the same row."""
        held = self._held.get(result.recipient_id)
        if held is not None and held.recipient.attempts == result.attempt:
            del self._held[result.recipient_id]

    async def postpone(
        self,
        recipients: Sequence[ClaimedRecipient],
        due_at: datetime,
        reason: str | None,
        site: str | None = None,
        group: tuple[uuid.UUID, str, str] | None = None,
    ) -> None:
        """Release these claims unattempted, due at `due_at`, with the reason they wait (or, with
        a `site`, into that site's queue, with the other due rows of their `group`: org, lane,
        domain). The postponements of a claim round go back in one statement."""
        done = asyncio.get_running_loop().create_future()
        self._postponing.extend(
            _Postponing(r, due_at, reason, site, done, group) for r in recipients
        )
        if self._postponer is None or self._postponer.done():
            self._postponer = asyncio.create_task(self._postpone_batches(), name="postpone")
        await asyncio.shield(done)

    async def _postpone_batches(self) -> None:
        while self._postponing:
            await asyncio.sleep(0)  # the postponements of this moment join the batch
            batch, self._postponing = self._postponing, []
            try:
                await store_leases.postpone_leases(
                    self.pool,
                    [p.recipient.id for p in batch],
                    owner=self.owner,
                    attempts=[p.recipient.attempts for p in batch],
                    due_at=[p.due_at for p in batch],
                    reasons=[p.reason for p in batch],
                    sites=[p.site for p in batch],
                )
                moves = {
                    (*p.group, p.site, p.reason)
                    for p in batch
                    if p.site is not None and p.group is not None
                }
                if moves:
                    await store_leases.join_site_queues(self.pool, sorted(moves, key=str))
            except Exception as exc:
                # No longer renewed, the claims run out and the lease sweeper queues them again.
                if not isinstance(exc, DB_ERRORS):
                    log.exception("could not hand back %d claimed recipient(s)", len(batch))
                else:
                    log.warning("could not hand back %d claimed recipient(s): %s", len(batch), exc)
            for p in batch:
                self._held.pop(p.recipient.id, None)
                if not p.done.done():
                    p.done.set_result(None)

    async def release_all(self) -> int:
        """At stop: every claim still held goes back to the queue now; returns how many did.
        A database error is raised, and the claims stay held (their leases run out)."""
        ids, attempts = self._claims(list(self._held))
        released = await store_leases.release_leases(
            self.pool, ids, owner=self.owner, attempts=attempts
        )
        self._held.clear()
        return released

    async def renew_loop(self) -> None:
        """Renew, every quarter lease, the leases that are a third of a lease old."""
        lease = self.lease
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(1.0, lease / 4))
            now = loop.time()
            due = [rid for rid, held in self._held.items() if now - held.renewed_at >= lease / 3]
            if not due:
                continue
            ids, attempts = self._claims(due)
            try:
                await store_leases.renew_leases(
                    self.pool, ids, owner=self.owner, lease=lease, attempts=attempts
                )
            except DB_ERRORS as exc:
                log.warning("could not renew %d lease(s): %s", len(due), exc)
                continue
            except Exception:
                log.exception("could not renew %d lease(s)", len(due))
                continue
            for rid in due:
                held = self._held.get(rid)
                if held is not None:
                    held.renewed_at = now

    def _claims(self, ids: Sequence[uuid.UUID]) -> tuple[list[uuid.UUID], list[int]]:
        """The (recipient id, attempt number) of each claim held among `ids`."""
        held = [(rid, self._held[rid].recipient.attempts) for rid in ids if rid in self._held]
        return [rid for rid, _ in held], [n for _, n in held]
