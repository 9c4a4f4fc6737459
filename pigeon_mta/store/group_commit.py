"""Group commit for the submission path: messages that arrive while a commit is under way share
the next one.

Each accepted message needs its own commit before its `250`, and a commit costs a statement, a
round trip and a WAL flush. With many sessions in one process, messages finish their DATA phase
close together; instead of one statement each, the ones waiting when a commit finishes go into the
next statement together (`store.queue.enqueue_many`). Nothing waits for a timer: a lone message is
written at once, in a statement of its own; batches form only when commits are already busy. Every
message of a batch is committed or none is, and each caller learns the outcome of the commit that
holds its message; a batch refused for any reason other than a database outage is tried again one
message at a time, so one bad message cannot fail its neighbours.

A message that this process's delivery engine has room for is handed to it as it is committed:
its recipients are queued already claimed by that engine (model.Handoff), which starts delivering
them when the commit returns, with no claim statement, no body read back and no wake-up of other
processes. This is most of the mail while the engines keep up; the rest is queued for a claim
and announced (`on_queued`, store/notify.py's NotifySender).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import asyncpg

from pigeon_mta.ids import new_ids
from pigeon_mta.model import ClaimedRecipient, ClaimedRow, Envelope, Handoff
from pigeon_mta.store import duplicates as store_duplicates
from pigeon_mta.store.duplicates import Duplicates, Enqueued
from pigeon_mta.store.errors import DB_ERRORS, is_about_the_values
from pigeon_mta.store.queue import recipient_domain

log = logging.getLogger(__name__)


class Engine(Protocol):
    """This process's delivery engine, as the group commit hands it messages
    (outbound/engine.py)."""

    def reserve(self, recipients: int, org_id: uuid.UUID) -> tuple[str, float] | None:
        """Room for a message of this many recipients of `org_id`, kept until `adopt` or
        `unreserve`: the lease owner and lease its rows are written with; None when it has no
        room now (or none for the org)."""

    def unreserve(self, recipients: int, org_id: uuid.UUID) -> None:
        """A reservation not used (the commit failed, or did not hand the message off)."""

    def adopt(self, rows: Sequence[ClaimedRow]) -> None:
        """The committed recipients of a reservation, claimed by it: deliver them."""


@dataclass(frozen=True)
class _Waiting:
    queue_id: uuid.UUID
    envelope: Envelope
    committed: asyncio.Future[Duplicates | None]


# Statements under way at once per process; also the size of a worker's commit pool
# (store.connect.commit_pool). One: the messages that finish while a commit runs share the next
# statement instead of half of them going alone into a second one. A lone message costs PostgreSQL
# about three times the CPU of a message in a batch (bench/README.md, "End to end"), and the
# processes of `serve` still keep several commits under way.
MAX_COMMITS = 1


class GroupCommit:
    """`await group.enqueue(queue_id, envelope)` returns once the message is committed (or raises
    what the commit raised), with the recipients that were not queued again as duplicates
    (store/duplicates.py), None when there were none."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        max_batch: int = 64,
        max_commits: int = MAX_COMMITS,
        engine: Engine | None = None,
        on_queued: Callable[[int], None] | None = None,
    ) -> None:
        """`max_batch`: messages per statement. `max_commits`: statements under way at once.
        `engine`: this process's delivery engine, handed the messages it has room for.
        `on_queued(n)`: after a commit that queued a message of n recipients for a claim."""
        self._pool = pool
        self._max_batch = max_batch
        self._max_commits = max_commits
        self._engine = engine
        self._on_queued = on_queued
        self._waiting: list[_Waiting] = []
        self._commits: set[asyncio.Task[None]] = set()

    async def enqueue(self, queue_id: uuid.UUID, envelope: Envelope) -> Duplicates | None:
        if not envelope.recipients:
            raise ValueError("a message needs at least one recipient")
        committed: asyncio.Future[Duplicates | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(queue_id, envelope, committed))
        self._start_commits()
        return await committed

    def _start_commits(self) -> None:
        while self._waiting and len(self._commits) < self._max_commits:
            batch = self._waiting[: self._max_batch]
            del self._waiting[: self._max_batch]
            task = asyncio.ensure_future(self._commit(batch))
            self._commits.add(task)
            task.add_done_callback(self._commit_done)

    def _commit_done(self, task: asyncio.Task[None]) -> None:
        self._commits.discard(task)
        self._start_commits()

    async def _commit(self, batch: list[_Waiting]) -> None:
        offered = [self._offer(w.envelope) for w in batch]
        try:
            enqueued = await store_duplicates.enqueue_submitted(
                self._pool, [(w.queue_id, e) for w, e in zip(batch, offered, strict=True)]
            )
        except BaseException as exc:
            for e in offered:
                if e.handoff is not None and self._engine is not None:
                    self._engine.unreserve(len(e.recipients), e.org_id)
            if len(batch) > 1 and _worth_one_by_one(exc):
                log.warning(
                    "a batch of %d messages was refused (%s); committing them one by one",
                    len(batch),
                    exc,
                )
                await asyncio.gather(*(self._commit([w]) for w in batch))
                return
            for waiting in batch:
                _settle(waiting.committed, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            for waiting, envelope in zip(batch, offered, strict=True):
                self._deliver(waiting.queue_id, envelope, enqueued)
                _settle(waiting.committed, enqueued.duplicates.get(waiting.queue_id))

    def _offer(self, envelope: Envelope) -> Envelope:
        """The envelope with a handoff when the engine has room for it."""
        if self._engine is None or envelope.received_at is None:
            return envelope
        if envelope.send_at is not None or envelope.order_key is not None:
            # Not before its time, nor before the mail ahead of it: the claim decides.
            return envelope
        room = self._engine.reserve(len(envelope.recipients), envelope.org_id)
        if room is None:
            return envelope
        owner, lease = room
        # The engine is handed the rows by id: the ids are made now if the submitter did not.
        ids = envelope.recipient_ids or tuple(new_ids(len(envelope.recipients)))
        return dataclasses.replace(envelope, handoff=Handoff(owner, lease), recipient_ids=ids)

    def _deliver(self, queue_id: uuid.UUID, e: Envelope, enqueued: Enqueued) -> None:
        """After the commit: hand the message to the engine, or announce it to the claimers."""
        if e.handoff is not None and self._engine is not None:
            if enqueued.handed_off and e.received_at is not None:
                self._engine.adopt(
                    [
                        ClaimedRow(
                            queue_id=queue_id,
                            org_id=e.org_id,
                            sender=e.sender,
                            header_message_id=e.header_message_id,
                            received_at=e.received_at,
                            domain=recipient_domain(address),
                            body=e.body,
                            lane=e.lane,
                            expires_at=e.expires_at,
                            recipient=ClaimedRecipient(
                                id=rid,
                                address=address,
                                attempts=1,
                                queued_at=e.received_at,
                                suppressed=enqueued.suppressed.get(rid),
                            ),
                        )
                        for rid, address in zip(e.recipient_ids, e.recipients, strict=True)
                    ]
                )
                return
            self._engine.unreserve(len(e.recipients), e.org_id)
        duplicates = enqueued.duplicates.get(queue_id)
        queued = len(e.recipients) - (len(duplicates.originals) if duplicates else 0)
        if queued and self._on_queued is not None:
            self._on_queued(queued)


def _worth_one_by_one(exc: BaseException) -> bool:
    """A refusal of the data (of one message, perhaps: a value, a constraint, a row its index
    cannot hold) rather than an outage or a read-only database, which would refuse each message
    alone just the same."""
    return isinstance(exc, DB_ERRORS) and is_about_the_values(exc)


def _settle(
    future: asyncio.Future[Duplicates | None], outcome: BaseException | Duplicates | None
) -> None:
    if future.done():  # its caller was cancelled; the outcome is theirs to log, not ours
        return
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
