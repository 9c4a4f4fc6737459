"""Queue administration: listing and showing recipients, bulk retry and cancel (the summary is
store/queue_summary.py).

A bulk action and its dry run share one WHERE clause, built once from a `Selection`: the dry run
counts exactly the rows the action would then update. Rows being delivered right now are never
part of an action (their worker would overwrite the change when it records its outcome); both the
dry run and the action report how many such rows matched and were left alone. A row whose lease
ran out is not being delivered: nobody holds it (its worker died, or could not record), and the
sweeper would queue it again. Retry and cancel take it like a queued row, whether a server runs
or not; its old claim, should it ever record, is fenced out by the status (store/outcomes.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import asyncpg

from pigeon_mta.model import Status
from pigeon_mta.store.executor import Executor
from pigeon_mta.store.queue import NOTIFY_CHANNEL

# "deferred" is not a status column value: it is a queued row that was attempted before.
DEFERRED = "deferred"
# Nor is "stale": a delivering row whose lease ran out (what the lease sweeper queues again).
STALE = "stale"
LISTABLE = (DEFERRED, *(str(s) for s in Status))
RETRYABLE = (DEFERRED, STALE, Status.BOUNCED, Status.EXPIRED)
CANCELLABLE = (Status.QUEUED, DEFERRED, STALE)

Action = Literal["retry", "cancel"]


def placeholder(value: Any, params: list[Any], cast: str = "") -> str:
    """Append `value` to a statement's parameters; returns its placeholder ($n, with `cast`)."""
    params.append(value)
    return f"${len(params)}{cast}"


@dataclass(frozen=True)
class Selection:
    """Which recipient rows a command is about. Empty fields do not restrict."""

    statuses: tuple[str, ...] = ()  # column values, or "deferred"
    domain: str | None = None
    org_id: uuid.UUID | None = None
    older_than: float | None = None  # seconds since the recipient was queued
    ids: tuple[uuid.UUID, ...] = ()  # message (queue) ids or recipient ids
    lane: str | None = None

    def where(self, params: list[Any], *, statuses: Sequence[str] | None = None) -> str:
        """The SQL condition on `recipient r`; appends its parameters to `params`."""

        def param(value: Any) -> str:
            return placeholder(value, params)

        conditions: list[str] = []
        wanted = self.statuses if statuses is None else statuses
        if wanted:
            plain = [s for s in wanted if s not in (DEFERRED, STALE)]
            alternatives = []
            if plain:
                alternatives.append(f"r.status = ANY ({param(plain)}::text[])")
            if DEFERRED in wanted:
                alternatives.append("(r.status = 'queued' AND r.attempts > 0)")
            if STALE in wanted:
                alternatives.append("(r.status = 'delivering' AND r.lease_until < now())")
            conditions.append("(" + " OR ".join(alternatives) + ")")
        if self.domain:
            conditions.append(f"r.domain = {param(self.domain.lower())}")
        if self.org_id:
            conditions.append(f"r.org_id = {param(self.org_id)}")
        if self.lane is not None:
            conditions.append(f"r.lane = {param(self.lane)}")
        if self.older_than is not None:
            conditions.append(
                f"r.created_at < now() - make_interval(secs => {param(float(self.older_than))})"
            )
        if self.ids:
            ids = param(list(self.ids))
            conditions.append(f"(r.id = ANY ({ids}::uuid[]) OR r.message_id = ANY ({ids}::uuid[]))")
        return " AND ".join(conditions) or "true"


# ---------------------------------------------------------------- bulk actions

# The new state of a row an action touches. A retried bounce or expiry gets a fresh max_age from
# now (created_at restarts; otherwise the expiry would take it back at its next pass), and its
# sender may be warned of a delay again in that new life.
_SET = {
    "retry": """status = 'queued', next_attempt_at = now(), updated_at = now(),
                lease_until = NULL, lease_owner = NULL,
                site = CASE WHEN r.site = 'later' THEN NULL ELSE r.site END,
                created_at = CASE WHEN r.status IN ('bounced', 'expired') THEN now()
                                  ELSE r.created_at END,
                delay_warned_at = CASE WHEN r.status IN ('bounced', 'expired') THEN NULL
                                       ELSE r.delay_warned_at END""",
    "cancel": """status = 'cancelled', lease_until = NULL, lease_owner = NULL,
                 updated_at = now()""",
}


# What the attempt log says of an action (see migration 0007).
_OUTCOME = {"retry": "retried", "cancel": "cancelled"}
_NOTE = {
    "retry": "made due now by an operator (pigeon-mta queue retry)",
    "cancel": "cancelled by an operator (pigeon-mta queue cancel); it will not be delivered",
}


@dataclass(frozen=True)
class ActionResult:
    action: Action
    dry_run: bool
    count: int  # rows touched (or, with dry_run, that would be)
    delivering: int  # rows that matched but are being delivered now, left alone


async def bulk_action(
    db: asyncpg.Connection, action: Action, selection: Selection, *, dry_run: bool
) -> ActionResult:
    """Retry or cancel the selected rows (or, with dry_run, count them), in one transaction."""
    allowed = RETRYABLE if action == "retry" else CANCELLABLE
    wrong = [s for s in selection.statuses if s not in allowed]
    if wrong:
        raise ValueError(f"cannot {action} recipients that are {', '.join(wrong)}")
    statuses = selection.statuses or allowed
    params: list[Any] = []
    where = selection.where(params, statuses=statuses)
    busy_params: list[Any] = []
    busy_where = selection.where(busy_params, statuses=[Status.DELIVERING])
    async with db.transaction():
        if dry_run:
            count = await db.fetchval(f"SELECT count(*) FROM recipient r WHERE {where}", *params)
        else:
            # Each touched recipient gets an attempt-log row saying what the operator did.
            count = await db.fetchval(
                f"""WITH touched AS (
                        UPDATE recipient r SET {_SET[action]} WHERE {where}
                        RETURNING r.id, r.message_id, r.org_id, r.attempts
                    ), logged AS (
                        INSERT INTO attempt (id, recipient_id, message_id, org_id, attempt,
                                             started_at, outcome, response)
                        SELECT gen_random_uuid(), id, message_id, org_id, attempts, now(),
                               {placeholder(_OUTCOME[action], params, "::text")},
                               {placeholder(_NOTE[action], params, "::text")}
                        FROM touched
                        RETURNING 1
                    )
                    SELECT count(*) FROM logged""",
                *params,
            )
            if action == "retry" and count:
                # Wake idle workers now rather than at their next poll (sent on commit).
                await db.execute("SELECT pg_notify($1, '')", NOTIFY_CHANNEL)
        # lease_until is set exactly while a row is being delivered (migration 0006); saying so
        # lets the count read recipient_leased instead of scanning the table for the status. A
        # lease that ran out holds nothing (STALE): such rows were part of the action.
        delivering = await db.fetchval(
            f"SELECT count(*) FROM recipient r WHERE {busy_where} AND r.lease_until >= now()",
            *busy_params,
        )
    return ActionResult(action, dry_run, int(count), int(delivering))


# ---------------------------------------------------------------- list and show


@dataclass(frozen=True)
class RecipientRow:
    id: uuid.UUID
    queue_id: uuid.UUID
    org: str
    sender: str
    address: str
    status: str
    lane: str
    attempts: int
    created_at: datetime
    next_attempt_at: datetime
    lease_owner: str | None
    last_code: int | None
    last_enhanced_code: str | None
    last_response: str | None
    delay_warned_at: datetime | None  # when its sender was warned of the delay (bounces)

    @property
    def last_reply(self) -> str | None:
        parts = [str(p) for p in (self.last_code, self.last_enhanced_code, self.last_response) if p]
        return " ".join(parts) or None


_ROW_COLUMNS = """r.id, r.message_id AS queue_id, o.name AS org, m.sender, r.address, r.status,
    r.lane, r.attempts, r.created_at, r.next_attempt_at, r.lease_owner, r.last_code,
    r.last_enhanced_code, r.last_response, r.delay_warned_at"""


def _recipient_row(row: asyncpg.Record) -> RecipientRow:
    """A row as `queue list` and `queue show` print it: a queued row that was tried before says
    "deferred", as `--status deferred` selects it and the summary counts it."""
    fields = {k: row[k] for k in RecipientRow.__dataclass_fields__}
    if fields["status"] == Status.QUEUED and fields["attempts"] > 0:
        fields["status"] = DEFERRED
    return RecipientRow(**fields)


async def unknown_ids(
    db: Executor, ids: Sequence[uuid.UUID], *, org_id: uuid.UUID | None = None
) -> list[uuid.UUID]:
    """Those of `ids` that are neither a queue id nor a recipient id (in the org, when given)."""
    rows = await db.fetch(
        """SELECT i FROM unnest($1::uuid[]) AS i
           WHERE NOT EXISTS (SELECT 1 FROM message m
                             WHERE m.id = i AND ($2::uuid IS NULL OR m.org_id = $2))
             AND NOT EXISTS (SELECT 1 FROM recipient r
                             WHERE r.id = i AND ($2::uuid IS NULL OR r.org_id = $2))""",
        list(ids),
        org_id,
    )
    return [r["i"] for r in rows]


async def list_recipients(
    db: Executor, selection: Selection, *, limit: int = 100
) -> list[RecipientRow]:
    """The selected recipients, oldest first. With no status given, the live queue only."""
    params: list[Any] = []
    statuses = selection.statuses or (Status.QUEUED, Status.DELIVERING)
    where = selection.where(params, statuses=statuses)
    params.append(limit)
    # The LIMIT is taken on recipient alone, before the joins: the live rows in order come from
    # recipient_live (migration 0012), and only the rows shown are joined.
    rows = await db.fetch(
        f"""SELECT {_ROW_COLUMNS}
            FROM (SELECT * FROM recipient r WHERE {where}
                  ORDER BY r.created_at, r.id LIMIT ${len(params)}) r
            JOIN message m ON m.id = r.message_id JOIN org o ON o.id = r.org_id
            ORDER BY r.created_at, r.id""",
        *params,
    )
    return [_recipient_row(r) for r in rows]


@dataclass(frozen=True)
class MessageDetail:
    queue_id: uuid.UUID
    org: str
    sender: str
    header_message_id: str | None
    size: int
    received_at: datetime
    listener: str
    client_ip: str | None
    auth_user: str | None
    lane: str
    recipients: list[RecipientRow]
    attempts: list[dict[str, Any]] = field(default_factory=list)  # when a recipient was named


async def show(db: Executor, ref: uuid.UUID, *, org_id: uuid.UUID | None = None) -> MessageDetail:
    """A message by queue id (all its recipients), or by recipient id (that one and its attempts).

    Raises LookupError when no message or recipient has the id (in the org, when one is given).
    """
    queue_id = await db.fetchval(
        """SELECT m.id FROM message m WHERE m.id = $1 AND ($2::uuid IS NULL OR m.org_id = $2)
           UNION ALL
           SELECT r.message_id FROM recipient r
           WHERE r.id = $1 AND ($2::uuid IS NULL OR r.org_id = $2)
           LIMIT 1""",
        ref,
        org_id,
    )
    if queue_id is None:
        raise LookupError(f"no message or recipient has the id {ref}")
    message = await db.fetchrow(
        """SELECT m.id, o.name AS org, m.sender, m.header_message_id, m.size, m.received_at,
                  m.listener, host(m.client_ip) AS client_ip, m.auth_user, m.lane
           FROM message m JOIN org o ON o.id = m.org_id WHERE m.id = $1""",
        queue_id,
    )
    assert message is not None
    one_recipient = queue_id != ref
    rows = await db.fetch(
        f"""SELECT {_ROW_COLUMNS}
            FROM recipient r JOIN message m ON m.id = r.message_id JOIN org o ON o.id = r.org_id
            WHERE r.message_id = $1 AND (NOT $2 OR r.id = $3)
            ORDER BY r.address""",
        queue_id,
        one_recipient,
        ref,
    )
    attempts: list[dict[str, Any]] = []
    if one_recipient:
        attempts = [
            dict(a)
            for a in await db.fetch(
                """SELECT attempt, started_at, outcome, mx_host, ip, code, enhanced_code,
                          response, category, rule, applied
                   FROM attempt WHERE recipient_id = $1 ORDER BY started_at, recorded_at""",
                ref,
            )
        ]
    return MessageDetail(
        queue_id=message["id"],
        org=message["org"],
        sender=message["sender"],
        header_message_id=message["header_message_id"],
        size=message["size"],
        received_at=message["received_at"],
        listener=message["listener"],
        client_ip=message["client_ip"],
        auth_user=message["auth_user"],
        lane=message["lane"],
        recipients=[_recipient_row(r) for r in rows],
        attempts=attempts,
    )
