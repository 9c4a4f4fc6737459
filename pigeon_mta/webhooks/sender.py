"""The webhook sender: sends the events of the outbox (store/webhooks.py) with signed POSTs.

Every worker process runs one. It takes only what it can send at once: for each endpoint, up to
`webhooks.concurrency_per_endpoint` requests less those it has in flight there, whether the events
come from the record of its process's outcomes (`offer`, `take`) or from its claims. An endpoint
that stalls thus holds its own slots and nothing else: other endpoints are served as usual, mail
delivery shares nothing with it but the database pool (for one short statement at a time) and
the sender's room (one claim or record at a time, a statement each), and memory stays bounded by
the slots, whatever the backlog. A request that gets no 2xx within
`webhooks.timeout` is retried with exponential backoff and jitter until the event is
`webhooks.max_age` old; then the event is marked failed and stays in the table.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import typing
import uuid
from collections.abc import Sequence, Set
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg

from pigeon_mta import __version__, metrics
from pigeon_mta.backoff import backoff_delay
from pigeon_mta.config import WebhookSettings
from pigeon_mta.plain import plain_error, plain_text
from pigeon_mta.store import webhooks as store_webhooks
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.errors import is_about_the_values
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.webhooks import NO_OFFER, ClaimedEvent, EventResult, Offer
from pigeon_mta.webhooks.signing import signed_headers

log = logging.getLogger("pigeon_mta.webhooks")

USER_AGENT = f"pigeon-mta/{__version__}"
# Of a reply body, only this much is read (and discarded): enough to keep the connection for the
# next request when the endpoint answers briefly, as endpoints do.
REPLY_READ_LIMIT = 64 * 1024
# A claim's lease beyond the request timeout: time to record the outcome before the event is due
# again for another sender.
LEASE_MARGIN = 10.0
# Outcomes are recorded in one statement once the oldest has waited this long (seconds), or once
# this many have gathered: under load a request ends every few milliseconds, and a statement
# apiece would cost the database more than the requests.
RECORD_WAIT = 0.05
RECORD_BATCH = 64
# How long the record of outcomes waits for the sender's room (a claim's statement holds it) before
# it writes its events for any sender to claim instead.
OFFER_WAIT = 0.05


@dataclass(frozen=True)
class HttpReply:
    """What an endpoint answered: its status (None: no reply) and, unless 2xx, why it failed."""

    status: int | None
    error: str | None

    @property
    def accepted(self) -> bool:
        return self.status is not None and 200 <= self.status <= 299


def new_session(settings: WebhookSettings) -> aiohttp.ClientSession:
    """The HTTP client of a sender: keep-alive connections, the request timeout of the settings.
    The connector sets no limit of its own; the sender's per-endpoint slots are the limit."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=float(settings.timeout)),
        headers={"User-Agent": USER_AGENT},
    )


async def post_event(
    session: aiohttp.ClientSession, url: str, secret: str, event_id: str, body: bytes
) -> HttpReply:
    """POST one event, signed; never raises for what the endpoint or the network does."""
    headers = {"Content-Type": "application/json", **signed_headers(secret, event_id, body)}
    try:
        async with session.post(url, data=body, headers=headers, allow_redirects=False) as reply:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await reply.content.read(REPLY_READ_LIMIT)
            if 200 <= reply.status <= 299:
                return HttpReply(reply.status, None)
            # The reason phrase is the endpoint's: undecodable bytes come as lone surrogates.
            reason = plain_text(reply.reason or "", 200)
            return HttpReply(reply.status, f"HTTP {reply.status} {reason}".strip())
    except TimeoutError:
        timeout = session.timeout.total
        return HttpReply(None, f"no reply within {timeout:g}s")
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        return HttpReply(None, plain_error(exc, 500))


def judge(
    event: ClaimedEvent,
    reply: HttpReply,
    *,
    settings: WebhookSettings,
    now: datetime,
    rng: random.Random | None = None,
) -> EventResult:
    """A request's reply -> the event's new state: delivered, pending until the next try, or
    failed once the next try would come after webhooks.max_age."""
    if reply.accepted:
        return EventResult(event, store_webhooks.DELIVERED, reply.status, None)
    delay = backoff_delay(event.attempts, settings.retry_initial, settings.retry_max, rng)
    next_at = now + timedelta(seconds=delay)
    if next_at > event.created_at + timedelta(seconds=settings.max_age):
        return EventResult(event, store_webhooks.FAILED, reply.status, reply.error)
    return EventResult(event, store_webhooks.PENDING, reply.status, reply.error, next_at)


class WebhookSender:
    """One worker process's sender (a Service of app.worker_services).

    Its events come two ways. The record of this process's delivery outcomes writes the new events
    of the webhooks it has room for already claimed for it, and hands them over (`offer`, `take`):
    under load that is nearly every event, sent with no claim and no read of its own. The outbox
    holds the rest (events written without room, by other processes or by expiry, and retries),
    claimed when a record left some there, when a claim filled a webhook's room (there may be
    more), and at every poll interval.
    """

    name = "webhooks"

    def __init__(self, settings: WebhookSettings, pool: asyncpg.Pool) -> None:
        self.settings = settings
        self.pool = pool
        self.lease = float(settings.timeout) + LEASE_MARGIN
        self._session: aiohttp.ClientSession | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()
        # Requests in flight, by endpoint, and the event each task sends.
        self._busy: collections.Counter[uuid.UUID] = collections.Counter()
        self._sending: dict[asyncio.Task[None], ClaimedEvent] = {}
        # Outcomes not recorded yet (at most one per slot), and when the oldest came.
        self._results: list[EventResult] = []
        self._results_since = 0.0
        self._db_healthy = True
        # Held by one record of outcomes (from `offer` to `take`) or one claim at a time: the
        # two together could fill a webhook's room twice. A claim holds it for its statement
        # alone (the connection is taken first), and a record waits for it at most OFFER_WAIT.
        self._room = asyncio.Lock()
        self._offered: Offer | None = None
        # The webhooks whose due events the outbox may hold beyond what this sender has claimed:
        # claimed as soon as they have room. Every webhook is looked for at each poll interval.
        self._backlogged: set[uuid.UUID] = set()
        self._last_claim = 0.0

    async def start(self) -> None:
        self._session = new_session(self.settings)
        self._runner = asyncio.create_task(self._run(), name="webhook-sender")

    async def stop(self, deadline: float) -> None:
        """Claim nothing more; let requests in flight finish until `deadline`, record what they
        did, and hand back the events of those still unanswered."""
        self._stopping = True
        self._wake.set()
        loop = asyncio.get_running_loop()
        if self._runner is not None:
            await self._runner
        if self._sending:
            await asyncio.wait(list(self._sending), timeout=max(0.0, deadline - loop.time()))
        unsent = list(self._sending.values())
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
        try:
            await self._record()
            await store_webhooks.release_events(self.pool, unsent)
        except DB_ERRORS as exc:
            # The events are due again when their leases pass: sent again, never lost.
            log.warning("webhook sender could not record its last outcomes: %s", exc)
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------ the record's handoff

    async def offer(self) -> Offer:
        """The room of every webhook here (webhooks.concurrency_per_endpoint less the requests
        in flight to it), held for one record of outcomes until `take`; after a claim or
        another record that holds it. None once the sender is stopping, or if the room is not
        free within OFFER_WAIT: the record of mail never waits on webhooks for longer."""
        if self._stopping:
            return NO_OFFER
        try:
            await asyncio.wait_for(self._room.acquire(), OFFER_WAIT)
        except TimeoutError:
            return NO_OFFER
        if self._stopping:
            self._room.release()
            return NO_OFFER
        room = self.settings.concurrency_per_endpoint
        self._offered = Offer(
            {webhook: max(0, room - busy) for webhook, busy in self._busy.items()},
            room,
            self.lease,
        )
        return self._offered

    def take(self, offer: Offer, events: Sequence[ClaimedEvent], waiting: Set[uuid.UUID]) -> None:
        """The events a record wrote claimed for this sender: sent at once. The webhooks of
        `waiting` had new events beyond their room, left in the outbox: claimed when they have
        room."""
        if offer is self._offered:
            self._offered = None
            self._room.release()
        self._backlogged |= waiting
        for event in events:
            self._begin(event)
        self._wake.set()

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        poll = float(self.settings.poll_interval)
        while not self._stopping:
            self._wake.clear()
            claimed: list[ClaimedEvent] = []
            failed = True
            try:
                if self._results and (
                    loop.time() - self._results_since >= RECORD_WAIT
                    or len(self._results) >= RECORD_BATCH
                ):
                    await self._record()
                if loop.time() - self._last_claim >= poll or self._backlog_has_room():
                    async with self.pool.acquire() as conn, self._room:
                        # The pool hands out a proxy that behaves as the connection it wraps.
                        claimed = await self._claim(typing.cast(asyncpg.Connection, conn))
                if not self._db_healthy:
                    log.info("webhook sender: database reachable again")
                self._db_healthy = True
                failed = False
            except DB_ERRORS as exc:
                if self._db_healthy:
                    log.warning("webhook sender cannot reach the database: %s", exc)
                self._db_healthy = False
            except Exception:
                # The sender must outlive a bug in one round; the claims come back after
                # their lease.
                log.exception("webhook sender round failed")
            for event in claimed:
                self._begin(event)
            # Until a request finishes (a slot is free), a record hands events over, outcomes
            # are due to be recorded, or the poll interval passes (new events, retries that
            # came due).
            timeout = self._last_claim + poll - loop.time()
            if self._results:
                timeout = min(timeout, self._results_since + RECORD_WAIT - loop.time())
            if failed:
                timeout = poll  # the database, or a bug: try again a poll interval later
            with contextlib.suppress(TimeoutError):
                # Never less than a millisecond: whatever comes due, the loop must not spin.
                await asyncio.wait_for(self._wake.wait(), max(timeout, 0.001))

    def _backlog_has_room(self) -> bool:
        room = self.settings.concurrency_per_endpoint
        return any(self._busy[webhook] < room for webhook in self._backlogged)

    async def _claim(self, conn: Executor) -> list[ClaimedEvent]:
        room = self.settings.concurrency_per_endpoint
        busy = dict(self._busy)
        claimed = await store_webhooks.claim_due_events(
            conn, room=room, busy=busy, lease=self.lease
        )
        self._last_claim = asyncio.get_running_loop().time()
        # A webhook that had room is drained if the claim took less than its room, and may have
        # more due if it took all of it; one that had none stays as it was.
        taken = collections.Counter(event.webhook_id for event in claimed)
        for webhook in self._backlogged | set(taken):
            had = room - busy.get(webhook, 0)
            if had > 0 and taken[webhook] >= had:
                self._backlogged.add(webhook)
            elif had > 0:
                self._backlogged.discard(webhook)
        return claimed

    def _begin(self, event: ClaimedEvent) -> None:
        self._busy[event.webhook_id] += 1
        task = asyncio.create_task(self._send(event), name="webhook-post")
        self._sending[task] = event
        task.add_done_callback(self._sent)

    async def _send(self, event: ClaimedEvent) -> None:
        assert self._session is not None
        reply = await post_event(self._session, event.url, event.secret, str(event.id), event.body)
        result = judge(event, reply, settings=self.settings, now=datetime.now(UTC))
        outcome = {"pending": "retried"}.get(result.state, result.state)
        metrics.WEBHOOK_DELIVERIES.labels(outcome=outcome).inc()
        if result.state == store_webhooks.FAILED:
            log.warning(
                "webhook %s: event %s failed after %d request(s) (%s); it is kept as failed",
                event.webhook_id,
                event.id,
                event.attempts,
                reply.error,
            )
        if not self._results:
            self._results_since = asyncio.get_running_loop().time()
        self._results.append(result)

    def _sent(self, task: asyncio.Task[None]) -> None:
        event = self._sending.pop(task, None)
        if event is not None:
            self._busy[event.webhook_id] -= 1
            if self._busy[event.webhook_id] <= 0:
                del self._busy[event.webhook_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook request failed unexpectedly", exc_info=task.exception())
        self._wake.set()

    async def _record(self) -> None:
        """Record the outcomes gathered so far (`record_results`). If the database cannot be
        reached they wait for the next round (no new claim is made meanwhile, so they stay few);
        should this process die first, their events are due again when their leases pass."""
        results, self._results = self._results, []
        try:
            await record_results(self.pool, results)
        except RecordInterrupted as stopped:
            self._results = [*stopped.unrecorded, *self._results]
            raise stopped.error from None


class RecordInterrupted(Exception):
    """The database stopped a record part-way: what was not recorded, and why."""

    def __init__(self, error: BaseException, unrecorded: Sequence[EventResult]) -> None:
        super().__init__(str(error))
        self.error = error
        self.unrecorded = list(unrecorded)


async def record_results(db: Executor, results: Sequence[EventResult]) -> None:
    """Record webhook results in one statement. A failure that is about some result in it
    (`is_about_the_values`) would fail again for ever and stop every record of the sender: each
    result is then recorded alone, one that fails alone is recorded with its error made plain,
    and one that still fails is left to its lease (sent again: at least once). Any other failure
    raises RecordInterrupted with the results not recorded."""
    try:
        await store_webhooks.record_event_results(db, results)
        return
    except Exception as exc:
        if not is_about_the_values(exc):
            raise RecordInterrupted(exc, results) from exc
        log.error(
            "webhook sender could not record %d result(s) (%s); recording them one by one",
            len(results),
            plain_error(exc),
        )
    for i, result in enumerate(results):
        plain = dataclasses.replace(
            result, error=None if result.error is None else plain_text(result.error, 500)
        )
        failure: BaseException | None = None
        for attempt in (result, plain):
            try:
                await store_webhooks.record_event_results(db, [attempt])
                failure = None
                break
            except Exception as exc:
                if not is_about_the_values(exc):
                    raise RecordInterrupted(exc, results[i:]) from exc
                failure = exc
        if failure is not None:
            log.error(
                "webhook %s: the result of event %s cannot be recorded (%s); it is sent again "
                "when its lease runs out",
                result.event.webhook_id,
                result.event.id,
                plain_error(failure),
            )
