"""DSNs to senders: built for failed, expired and long-delayed recipients, queued atomically.

A recipient that becomes `bounced` or `expired` and the DSN that tells its sender commit together:
a crash can lose neither alone. The DSN is an ordinary queued message (null sender, org of the
original), so it is delivered, retried and logged like any other mail. The store reads the
recipients (store/dsn.py) and queues what is built here (dsn.py writes the bytes).

One DSN never costs the others, nor the outcomes they report: a DSN that cannot be built from
what the recipients' replies say is built again from their plain ASCII (`Reply.plain`), and one
that still cannot be built, or that the database refuses to queue (each is then queued alone,
under a savepoint), is left out, with an error in the log and `pigeon_dsn_failures_total`
counting it. Any other error fails the transaction, so that an outcome and its DSN commit together
or not at all.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from pigeon_mta.dsn import (
    EXPIRED_STATUS,
    MAX_ORIGINAL_HEADER_BYTES,
    OriginalMessage,
    RecipientReport,
    build_bounce,
    build_delay_warning,
    header_section,
)
from pigeon_mta.ids import new_id
from pigeon_mta.metrics import DSN_FAILURES
from pigeon_mta.model import Envelope, Status
from pigeon_mta.plain import plain_error, plain_text
from pigeon_mta.store import dsn as store_dsn
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store import upkeep as store_upkeep
from pigeon_mta.store.dsn import ReportedRecipient
from pigeon_mta.store.errors import is_bad_input
from pigeon_mta.store.executor import Executor, transaction
from pigeon_mta.store.upkeep import ExpiredRecipient, LaneMaxAge

log = logging.getLogger(__name__)

Build = Callable[[OriginalMessage, list[RecipientReport]], Envelope | None]

# Four bytes beyond the header limit: room for the empty line that ends a header section that size.
_HEAD_BYTES = MAX_ORIGINAL_HEADER_BYTES + 4


async def queue_bounces(
    db: Executor, recipient_ids: Sequence[uuid.UUID], *, hostname: str
) -> list[uuid.UUID]:
    """Queue one DSN per message for these bounced/expired recipients; returns the DSNs' queue ids.

    Recipients of null-sender mail (DSNs themselves) are skipped: a bounce is never bounced.
    Call it in the transaction that made the recipients final.
    """
    reported = await store_dsn.reported_recipients(db, recipient_ids, head_bytes=_HEAD_BYTES)
    failed = [r for r in reported if r.status in (Status.BOUNCED, Status.EXPIRED)]
    dsns: list[tuple[uuid.UUID, Envelope]] = []
    for original, recipients in _per_original(failed):
        envelope = _built(
            functools.partial(build_bounce, hostname=hostname),
            original,
            [_report(r) for r in recipients],
        )
        if envelope is not None:
            dsns.append((new_id(), envelope))
    return await _enqueue(db, dsns)


@dataclass(frozen=True)
class Expired:
    recipients: list[ExpiredRecipient]
    bounces: list[uuid.UUID]  # queue ids of the DSNs queued


async def expire_and_bounce(
    db: Executor,
    *,
    max_age: float,
    max_age_text: str,
    hostname: str,
    lane_max_ages: Sequence[LaneMaxAge] = (),
    limit: int = 1000,
) -> Expired:
    """Expire due recipients older than max_age (or their lane's, `lane_max_ages`), and queued
    ones past their message's deadline, and queue their DSNs (Status 4.4.7), atomically."""
    longest = max([max_age, *(lane.max_age for lane in lane_max_ages)])
    async with transaction(db) as conn:
        expired = await store_upkeep.expire_old_recipients(
            conn,
            max_age=max_age,
            max_age_text=max_age_text,
            lane_max_ages=lane_max_ages,
            limit=limit,
        )
        expired += await store_upkeep.expire_past_deadline(conn, window=longest, limit=limit)
        bounces = await queue_bounces(conn, [e.recipient_id for e in expired], hostname=hostname)
    return Expired(recipients=expired, bounces=bounces)


@dataclass(frozen=True)
class Warned:
    recipients: int  # recipients marked as warned (those of null-sender mail get no warning)
    warnings: list[uuid.UUID]  # queue ids of the DSNs (Action: delayed) queued


async def warn_delayed(
    db: Executor,
    *,
    after: float,
    max_age: float,
    hostname: str,
    lane_max_ages: Sequence[LaneMaxAge] = (),
    limit: int = 1000,
) -> Warned:
    """Tell the senders of recipients still being retried `after` seconds after they were queued
    (one DSN with Action: delayed per message and round, RFC 3464), once per recipient: the mark
    and the DSNs commit together. A recipient being delivered when its message's others are
    warned is warned at a later round if it is deferred again, in a DSN of its own. The DSN says
    until when delivery will be tried: the earliest expiry (created_at + max_age, or the lane's
    max_age of `lane_max_ages`) among those it names, so that it promises no try that will not
    happen."""
    own = {lane.lane: lane.max_age for lane in lane_max_ages}
    async with transaction(db) as conn:
        marked = await store_dsn.mark_delayed(conn, after=after, limit=limit)
        if not marked:
            return Warned(recipients=0, warnings=[])
        reported = await store_dsn.reported_recipients(conn, marked, head_bytes=_HEAD_BYTES)
        dsns: list[tuple[uuid.UUID, Envelope]] = []
        for original, recipients in _per_original(reported):
            until = min(
                r.created_at + timedelta(seconds=own.get(r.lane, max_age)) for r in recipients
            )
            envelope = _built(
                functools.partial(build_delay_warning, hostname=hostname, retry_until=until),
                original,
                [_report(r) for r in recipients],
            )
            if envelope is not None:
                dsns.append((new_id(), envelope))
        warnings = await _enqueue(conn, dsns)
    return Warned(recipients=len(marked), warnings=warnings)


def _built(
    build: Build, original: OriginalMessage, reports: list[RecipientReport]
) -> Envelope | None:
    """`build(original, reports)`; built again from the plain replies if that raises, and None
    (logged, counted) if that raises too."""
    plain = [
        dataclasses.replace(
            r,
            reply=None if r.reply is None else r.reply.plain(),
            remote_mta=None if r.remote_mta is None else plain_text(r.remote_mta, 255),
            status=None if r.status is None else plain_text(r.status, 16),
        )
        for r in reports
    ]
    for attempt, step, instead in (
        (reports, "plain", "building it from the plain replies"),
        (plain, "skipped", "its sender is not told"),
    ):
        try:
            return build(original, attempt)
        except Exception as exc:
            log.error(
                "could not build the DSN for message %s (%s); %s",
                original.queue_id,
                plain_error(exc),
                instead,
                exc_info=exc,
            )
            DSN_FAILURES.labels(step=step).inc()
    return None


async def _enqueue(db: Executor, dsns: list[tuple[uuid.UUID, Envelope]]) -> list[uuid.UUID]:
    """Queue the DSNs, all in one statement with one NOTIFY sent at commit; if the database
    refuses that statement for what is in it, each DSN alone, under a savepoint, leaving out
    (logged, counted) those it refuses. Returns the queue ids of those queued."""
    if not dsns:
        return []
    try:
        async with transaction(db) as conn:
            await store_queue.enqueue_many(conn, dsns, notify=True)
        return [queue_id for queue_id, _envelope in dsns]
    except Exception as exc:
        if not _refused(exc):
            raise
        if len(dsns) == 1:
            _left_out(dsns[0], exc)
            return []
    queued = []
    for dsn in dsns:
        try:
            async with transaction(db) as conn:
                await store_queue.enqueue_many(conn, [dsn], notify=True)
            queued.append(dsn[0])
        except Exception as exc:
            if not _refused(exc):
                raise
            _left_out(dsn, exc)
    return queued


def _refused(exc: BaseException) -> bool:
    """The database refused a DSN for what is in it (`is_bad_input`: a value it cannot store, a
    row its index cannot hold). Anything else (an outage, a trigger's refusal) fails the
    transaction: the outcome and its DSN commit together or not at all."""
    return is_bad_input(exc)


def _left_out(dsn: tuple[uuid.UUID, Envelope], exc: BaseException) -> None:
    queue_id, envelope = dsn
    log.error(
        "the database refused the DSN %s to <%s> (%s): its sender is not told",
        queue_id,
        plain_text(envelope.recipients[0], 100),
        plain_error(exc),
    )
    DSN_FAILURES.labels(step="refused").inc()


def _per_original(
    reported: Sequence[ReportedRecipient],
) -> list[tuple[OriginalMessage, list[ReportedRecipient]]]:
    """Recipients (ordered by message) grouped per original message: one DSN each."""
    per_message: dict[uuid.UUID, list[ReportedRecipient]] = {}
    for r in reported:
        per_message.setdefault(r.queue_id, []).append(r)
    grouped = []
    for recipients in per_message.values():
        first = recipients[0]
        original = OriginalMessage(
            queue_id=first.queue_id,
            org_id=first.org_id,
            sender=first.sender,
            received_at=first.received_at,
            header_message_id=first.header_message_id,
            headers=header_section(first.head),
        )
        grouped.append((original, recipients))
    return grouped


def _report(r: ReportedRecipient) -> RecipientReport:
    return RecipientReport(
        address=r.address,
        reply=r.last_reply,
        remote_mta=r.remote_mta,
        status=EXPIRED_STATUS if r.status == Status.EXPIRED else None,
        last_attempt_at=r.last_attempt_at,
    )
