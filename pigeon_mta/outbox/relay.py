"""The relay of one outbox: rows an application wrote to a table in its own database, in the
transaction of its change (outbox/table.py), become queued mail through the one intake, as the
HTTP API's requests do (sender policy, rate, lane, duplicates), and their queue ids go back.

A round claims a batch of waiting rows FOR UPDATE SKIP LOCKED in a transaction of the
application's database (relays of other processes and nodes take other rows) and holds it open
while, in pigeon-mta's database:
1. the keys given a queue id before are looked up (store/outbox_keys.py); one whose message is
   queued is answered with that queue id, unqueued again;
2. the other rows are composed (the API's JSON form, or raw with its envelope) and prepared;
3. their keys are given the queue ids of their messages, and only then are the messages
   committed (the group commit, shared with the listeners and the API).
It then writes each row's `queue_id` and `relayed_at`, or the refusal's sentence to `error`, and
commits. A relay that dies anywhere before that commit leaves its rows waiting; the next round
finds their keys and queues each message under the queue id its key was given, which the
message's primary key lets only one commit do: one message per key, whatever crashes.

What the application must correct (a sender its org may not use, a malformed message) is
refused: `error` is written and the row stays, and the rows after it flow. What is pigeon-mta's
trouble or passes (its database, a credential rate) leaves the row waiting for a later round. A
lost application database is connected again with backoff; `pigeon_outbox_reachable` and
/readyz say so meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from pigeon_mta import metrics
from pigeon_mta.api import problems
from pigeon_mta.api.compose import Composed, from_json, from_raw
from pigeon_mta.api.problems import Problem
from pigeon_mta.api.send import problem_of
from pigeon_mta.config import OUTBOX_LISTENER, OUTBOX_USER_PREFIX, OutboxSettings, Settings
from pigeon_mta.intake.accept import Intake, Prepared, Queued
from pigeon_mta.intake.refusal import Refusal
from pigeon_mta.intake.submission import Door, Submission, Submitter
from pigeon_mta.outbound.room import finish_task
from pigeon_mta.outbox.table import CHANNEL, Row, Table
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store import outbox_keys
from pigeon_mta.store.connect import DB_ERRORS

log = logging.getLogger("pigeon_mta.outbox")

# The application's database: retried after 1 s, doubling up to a minute.
RETRY_INITIAL = 1.0
RETRY_MAX = 60.0
# The backlog gauges are read this often, and relayed rows past retention deleted this often.
BACKLOG_EVERY = 5.0
PRUNE_EVERY = 10.0
# A round deletes up to PRUNE_ROUNDS batches of PRUNE_BATCH: 50,000 rows per 10 s, more than a
# relay moves.
PRUNE_BATCH = 5000
PRUNE_ROUNDS = 10
# A key is forgotten a day after its row could have been deleted.
KEY_MARGIN = 86400.0
# Errors of the application's database that a new connection may cure.
APP_DB_ERRORS = (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


class PigeonTrouble(Exception):
    """pigeon-mta's database failed during a round (the cause): its rows are left waiting."""


@dataclass
class Round:
    """What one round did with its rows."""

    relayed: list[tuple[int, uuid.UUID]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    repeats: int = 0
    waiting: int = 0  # left for a later round: pigeon-mta's trouble, or a rate

    @property
    def taken(self) -> int:
        return len(self.relayed) + len(self.refused) + self.waiting


class OutboxRelay:
    """One outbox's relay in one worker process (a Service of app.py)."""

    def __init__(
        self,
        settings: Settings,
        outbox: OutboxSettings,
        pool: asyncpg.Pool,
        intake: Intake,
        *,
        connect: Callable[[str], Awaitable[asyncpg.Connection]] | None = None,
    ) -> None:
        self.settings = settings
        self.outbox = outbox
        self.name = f"outbox {outbox.name}"
        self.pool = pool
        self.intake = intake
        self.table = Table(outbox.table)
        self._connect = connect or (
            lambda url: asyncpg.connect(url, timeout=settings.database.connect_timeout)
        )
        self._org_id: uuid.UUID | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rng = random.Random()
        self._rounds = 0  # relayed rounds, for the reconnection backoff

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self, deadline: float) -> None:
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            await finish_task(self._task, deadline - asyncio.get_running_loop().time())

    async def _run(self) -> None:
        delay = RETRY_INITIAL
        reachable = metrics.OUTBOX_REACHABLE.labels(outbox=self.outbox.name)
        while not self._stopping.is_set():
            rounds = self._rounds
            try:
                conn = await self._connect(self.outbox.database)
            except (*APP_DB_ERRORS, ValueError) as exc:  # ValueError: asyncpg's, of a bad URL
                self._warn("cannot connect to the application's database", exc, delay)
            else:
                reachable.set(1)
                try:
                    await self._relay_while_connected(conn)
                except APP_DB_ERRORS as exc:
                    self._warn("the application's database went away", exc, delay)
                except Exception:
                    log.exception("outbox %s: the relay failed; it starts again", self.outbox.name)
                finally:
                    reachable.set(0)
                    await _close(conn)
            if self._stopping.is_set():
                break
            if self._rounds > rounds:
                delay = RETRY_INITIAL  # it relayed on that connection: start the backoff anew
            await self._sleep(delay * (0.5 + self._rng.random()))
            delay = min(RETRY_MAX, delay * 2)

    def _warn(self, what: str, exc: BaseException, delay: float) -> None:
        log.warning(
            "outbox %s: %s: %s; trying again in about %.0fs",
            self.outbox.name,
            what,
            str(exc).strip() or type(exc).__name__,
            delay,
        )

    async def _relay_while_connected(self, conn: asyncpg.Connection) -> None:
        loop = asyncio.get_running_loop()

        def heard(*_args: object) -> None:
            self._wake.set()

        await conn.add_listener(CHANNEL, heard)
        log.info("outbox %s: relaying %s", self.outbox.name, self.outbox.table)
        next_backlog = next_prune = 0.0
        poll = float(self.outbox.poll_interval)
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                done = await self.relay_round(conn)
                self._rounds += 1
            except PigeonTrouble as trouble:
                log.warning(
                    "outbox %s: rows left waiting, pigeon-mta's database: %s",
                    self.outbox.name,
                    trouble.__cause__,
                )
                done = Round(waiting=1)
            now = loop.time()
            if now >= next_backlog:
                await self._upkeep(conn, self._read_backlog)
                next_backlog = now + BACKLOG_EVERY
            if now >= next_prune:
                await self._upkeep(conn, self._prune)
                next_prune = now + PRUNE_EVERY
            if done.waiting:
                # Rows wait for what passes by itself (pigeon-mta's database, a rate): come
                # back after the poll interval, not at the next insert.
                await self._sleep(poll)
            elif done.taken < self.outbox.batch:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), poll)

    async def _upkeep(
        self, conn: asyncpg.Connection, work: Callable[[asyncpg.Connection], Awaitable[None]]
    ) -> None:
        """The backlog's gauges and the pruning: a failure of theirs (a DELETE the application's
        role may not do) is logged and leaves the relay running."""
        try:
            await work(conn)
        except asyncpg.PostgresError as exc:
            log.warning("outbox %s: %s failed: %s", self.outbox.name, work.__name__, exc)

    async def relay_round(self, conn: asyncpg.Connection) -> Round:
        """One batch: claimed, relayed, written back, committed; what became of its rows."""
        async with conn.transaction():
            rows = await self.table.claim(conn, self.outbox.batch)
            if not rows:
                return Round()
            done = await self._relay(rows)
            await self.table.write_back(conn, done.relayed, done.refused)
        name = self.outbox.name
        metrics.OUTBOX_ROWS.labels(outbox=name, outcome="queued").inc(
            len(done.relayed) - done.repeats
        )
        if done.repeats:
            metrics.OUTBOX_ROWS.labels(outbox=name, outcome="repeat").inc(done.repeats)
        if done.refused:
            metrics.OUTBOX_ROWS.labels(outbox=name, outcome="refused").inc(len(done.refused))
        return done

    async def _relay(self, rows: list[Row]) -> Round:
        try:
            org_id = await self._org()
            keys = [r.key for r in rows]
            given = await outbox_keys.given(self.pool, org_id, self.outbox.name, keys)
        except DB_ERRORS as exc:
            raise PigeonTrouble from exc
        done = Round()
        composed: dict[int, Composed] = {}
        fresh: list[tuple[Row, Submission]] = []
        for row in rows:
            earlier = given.get(row.key)
            if earlier is not None and earlier[1]:
                done.relayed.append((row.id, earlier[0]))
                done.repeats += 1
                continue
            try:
                composed[row.id] = _compose(row, self.settings)
            except Problem as problem:
                self._refuse(done, row, problem.detail)
                continue
            except Exception as exc:  # a defect must cost its row, not the outbox
                log.exception("outbox %s: row %d could not be read", self.outbox.name, row.id)
                self._refuse(done, row, f"pigeon-mta could not read the row ({exc!r}); see its log")
                continue
            queue_id = earlier[0] if earlier is not None else None
            fresh.append((row, self._submission(row, composed[row.id], org_id, queue_id)))
        # Keyed rows one after the other, in row order: each message's received time is its
        # place in its key's order (store/claims.py); the others at once.
        keyed = [s for _, s in fresh if s.intent.order_key is not None]
        ordered = [await _prepared(self.intake, s) for s in keyed]
        parallel = await asyncio.gather(
            *(self.intake.prepare(s) for _, s in fresh if s.intent.order_key is None),
            return_exceptions=True,
        )
        places = iter(ordered), iter(parallel)
        prepared = [next(places[s.intent.order_key is None]) for _, s in fresh]
        ready: list[tuple[Row, Prepared]] = []
        for (row, _), made in zip(fresh, prepared, strict=True):
            if isinstance(made, BaseException):
                if not isinstance(made, Exception):
                    raise made
                log.error("outbox %s: row %d failed", self.outbox.name, row.id, exc_info=made)
                self._refuse(done, row, f"pigeon-mta failed on the row ({made!r}); see its log")
            elif isinstance(made, Refusal):
                self._refused_by_intake(done, row, made, composed[row.id])
            else:
                ready.append((row, made))
        if not ready:
            return done
        # The keys take their queue ids before any message is committed under them.
        offered = {row.key: p.queue_id for row, p in ready}
        try:
            taken = await outbox_keys.give(self.pool, org_id, self.outbox.name, offered)
        except DB_ERRORS as exc:
            raise PigeonTrouble from exc
        ready = [(row, p.with_queue_id(taken[row.key])) for row, p in ready]
        committed = await asyncio.gather(*(self.intake.commit(p) for _, p in ready))
        for (row, _), outcome in zip(ready, committed, strict=True):
            if isinstance(outcome, Queued):
                done.relayed.append((row.id, outcome.queue_id))
            else:
                self._refused_by_intake(done, row, outcome, composed[row.id])
        return done

    def _submission(
        self, row: Row, composed: Composed, org_id: uuid.UUID, queue_id: uuid.UUID | None
    ) -> Submission:
        return Submission(
            door=Door(listener=OUTBOX_LISTENER, trace="http", via=f"outbox {self.outbox.name}"),
            submitter=Submitter(
                org_id=org_id,
                org=self.outbox.org,
                auth_user=OUTBOX_USER_PREFIX + self.outbox.name,
                api_key=True,
            ),
            sender=str(composed.sender),
            recipients=composed.recipients,
            data=composed.data,
            lane=composed.lane,
            intent=composed.intent,
            content_key=hashlib.blake2b(
                (row.message or "").encode() + (row.raw or b""), digest_size=16
            ).digest(),
            queue_id=queue_id,
            repeatable=True,
        )

    def _refused_by_intake(
        self, done: Round, row: Row, refusal: Refusal, composed: Composed
    ) -> None:
        if refusal.passes:
            done.waiting += 1
            return
        problem = problem_of(refusal, self.outbox.org, composed, self.settings)
        self._refuse(done, row, problem.detail)

    def _refuse(self, done: Round, row: Row, detail: str) -> None:
        log.info(
            "outbox %s: row %d (key %r) refused: %s", self.outbox.name, row.id, row.key, detail
        )
        done.refused.append((row.id, detail))

    async def _org(self) -> uuid.UUID:
        if self._org_id is None:
            self._org_id = await store_orgs.ensure_org(self.pool, self.outbox.org)
        return self._org_id

    async def _read_backlog(self, conn: asyncpg.Connection) -> None:
        backlog = await self.table.backlog(conn)
        name = self.outbox.name
        metrics.OUTBOX_BACKLOG.labels(outbox=name).set(backlog.waiting)
        metrics.OUTBOX_REFUSED.labels(outbox=name).set(backlog.refused)
        metrics.OUTBOX_OLDEST_AGE.labels(outbox=name).set(max(0.0, backlog.oldest_age or 0.0))

    async def _prune(self, conn: asyncpg.Connection) -> None:
        """Relayed rows past retention and their keys, PRUNE_BATCH at a time until none is left
        (at most PRUNE_ROUNDS batches a round: as fast as a busy outbox relays)."""
        retention = float(self.outbox.retention)
        deleted = 0
        for _ in range(PRUNE_ROUNDS):
            gone = await self.table.prune(conn, retention, PRUNE_BATCH)
            deleted += gone
            if gone < PRUNE_BATCH:
                break
        try:
            for _ in range(PRUNE_ROUNDS):
                gone = await outbox_keys.prune(
                    self.pool,
                    self.outbox.name,
                    older_than=retention + KEY_MARGIN,
                    limit=PRUNE_BATCH,
                )
                if gone < PRUNE_BATCH:
                    break
        except DB_ERRORS as exc:
            log.warning("outbox %s: old keys not pruned: %s", self.outbox.name, exc)
        if deleted:
            log.info(
                "outbox %s: %d relayed row(s) past retention deleted", self.outbox.name, deleted
            )

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


def _compose(row: Row, settings: Settings) -> Composed:
    if row.message is not None:
        return from_json(row.message.encode(), settings.limits)
    if row.raw is None or row.mail_from is None or row.rcpt_to is None:
        raise Problem(
            problems.INVALID_FIELD,
            "The row needs either message, or raw with mail_from and rcpt_to.",
        )
    return from_raw(row.raw, [row.mail_from], list(row.rcpt_to), settings.limits)


async def _prepared(intake: Intake, submission: Submission) -> Prepared | Refusal | Exception:
    try:
        return await intake.prepare(submission)
    except Exception as exc:
        return exc


async def _close(conn: asyncpg.Connection) -> None:
    """Close the connection; one that does not close in 5 s is cut."""
    try:
        await asyncio.wait_for(conn.close(), 5)
    except (*APP_DB_ERRORS, TimeoutError):
        conn.terminate()
