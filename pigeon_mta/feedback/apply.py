"""From a feedback message to the events it records: which recipient pigeon sent to each report
item is about, and what it does there.

A message to a VERP address (`b-TOKEN@return-path-domain`, feedback/tokens.py) is about the one
recipient its token names: mail to a return-path address had one recipient, so every failed
item of the report is about that recipient, whatever address the reporting system names (it may
have expanded an alias). A token may also come back inside the report: a complaint's
Original-Mail-From, the original's Return-Path. A report with no valid token is matched by the
original's Message-ID and the reported address; a match in more than one org matches nothing.

- a report about a recipient still being delivered (it came before the outcome of the
  transaction it follows was recorded) is left unread and read again a few seconds later;
- a bounce: `hard` moves a delivered recipient to bounced and suppresses the address when its
  category suppresses for synchronous bounces too (outbound/classify.py `suppresses`); a soft
  one (a full mailbox) is recorded and changes nothing;
- a delay is recorded and changes nothing;
- a complaint suppresses the address, always.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pigeon_mta.feedback.parse import Item, Report
from pigeon_mta.feedback.tokens import SigningKey, read_token
from pigeon_mta.outbound.classify import suppresses
from pigeon_mta.store import feedback as store_feedback
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.feedback import Event, Outcome, Target


@dataclass(frozen=True)
class Found:
    """One feedback message, read and matched."""

    outcome: Outcome
    events: tuple[Event, ...]


def tokens_of(rcpt_to: Iterable[str], report: Report) -> list[str]:
    """The local parts that may hold a token: the feedback message's recipients' and the
    original's envelope senders'."""
    addresses = [*rcpt_to, *report.original_senders]
    return [a.rpartition("@")[0] for a in addresses if "@" in a]


@dataclass(frozen=True)
class Read:
    """A feedback message with its report."""

    feedback_id: uuid.UUID
    rcpt_to: Sequence[str]
    report: Report


async def match(db: Executor, batch: Sequence[Read], keys: Mapping[int, SigningKey]) -> list[Found]:
    """The events of a batch of reports (reads the recipients they name, in one statement for
    every token; writes nothing)."""
    tokens = {
        read.feedback_id: [
            t for t in (read_token(p, keys) for p in tokens_of(read.rcpt_to, read.report)) if t
        ]
        for read in batch
        if read.report.kind is not None
    }
    wanted = list(dict.fromkeys(t for ids in tokens.values() for t in ids))
    targets = await store_feedback.targets_by_id(db, wanted) if wanted else {}
    return [await _match(db, read, tokens.get(read.feedback_id, []), targets) for read in batch]


async def _match(
    db: Executor, read: Read, ids: list[uuid.UUID], targets: Mapping[uuid.UUID, Target]
) -> Found:
    report, feedback_id = read.report, read.feedback_id
    if report.kind is None:
        return Found(Outcome(feedback_id, store_feedback.NOT_UNDERSTOOD, None, report.detail), ())
    events: list[Event] = []
    if ids:
        # The first token that names a known recipient is the one the report is about.
        target = next((targets[i] for i in ids if i in targets), None)
        if target is not None and target.status == "delivering":
            # The report came before the outcome it follows was recorded (a gateway that
            # bounces at once): read it again once the recorder has moved the recipient.
            detail = f"{report.detail}; its recipient is being delivered: read again"
            return Found(Outcome(feedback_id, store_feedback.NEW, report.kind, detail), ())
        if target is not None:
            events = _events(feedback_id, target, report.items)
    elif report.original_message_id:
        for item in report.items:
            if item.address is None:
                continue
            found = await store_feedback.targets_by_message(
                db, report.original_message_id, item.address
            )
            if len({t.org_id for t in found}) == 1:
                events.extend(_events(feedback_id, found[0], [item]))
    if not events:
        why = "its token names no recipient" if ids else "no token and no matching message"
        detail = f"{report.detail}; {why}"
        return Found(Outcome(feedback_id, store_feedback.UNMATCHED, report.kind, detail), ())
    return Found(
        Outcome(feedback_id, store_feedback.APPLIED, report.kind, report.detail), tuple(events)
    )


def _events(feedback_id: uuid.UUID, target: Target, items: Iterable[Item]) -> list[Event]:
    """One event per kind for the recipient: the first hard item of the kind, else the first."""
    by_kind: dict[str, Item] = {}
    for item in items:
        earlier = by_kind.get(item.kind)
        if earlier is None or (item.hard and not earlier.hard):
            by_kind[item.kind] = item
    out = []
    for kind, item in by_kind.items():
        reported = item.address or target.address
        response = item.text
        if reported.lower() != target.address.lower():
            response = f"{response} (reported for {reported})"
        out.append(
            Event(
                feedback_id=feedback_id,
                recipient_id=target.recipient_id,
                kind=kind,
                hard=item.hard,
                code=item.code,
                enhanced_code=item.enhanced_code,
                response=response[:1000],
                category=item.category,
                feedback_type=item.feedback_type,
                suppress=kind == "complaint" or (item.hard and suppresses(item.category)),
            )
        )
    return out
