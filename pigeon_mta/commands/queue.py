"""`queue` (summary), `queue list`, `queue show`, `queue retry`, `queue cancel`; `queue suspend`
and `queue resume` are in commands/suspend.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pigeon_mta.commands import suspend
from pigeon_mta.commands.common import (
    CliError,
    add_common,
    eprint,
    format_age,
    jsonable,
    open_database,
    print_object,
    print_rows,
    text_cell,
)
from pigeon_mta.commands.suppress import org_named
from pigeon_mta.config import Duration
from pigeon_mta.store import admin_queue, suspensions
from pigeon_mta.store import budgets as store_budgets
from pigeon_mta.store.admin_queue import Selection

REPLY_WIDTH = 60  # table cells; --json gives the whole reply


def register(sub: Any) -> None:
    queue = sub.add_parser("queue", help="queue summary and administration")
    add_common(queue)
    queue.add_argument("--top", type=int, default=10, metavar="N", help="destinations shown (10)")
    queue.add_argument(
        "--exact",
        action="store_true",
        help="count finished recipients exactly (a full table scan) instead of estimating",
    )
    queue.set_defaults(handler=cmd_summary)
    commands = queue.add_subparsers(dest="queue_command", metavar="COMMAND")

    p = commands.add_parser("list", help="list recipients (default: the live queue)")
    add_common(p)
    _add_filters(p, (*admin_queue.LISTABLE, "all"))
    p.add_argument("--limit", type=int, default=100, metavar="N", help="at most N rows (100)")
    p.set_defaults(handler=cmd_list)

    p = commands.add_parser("show", help="a message (queue id) or a recipient, and its state")
    add_common(p)
    p.add_argument("id", metavar="ID", help="queue id or recipient id")
    p.add_argument("--org", metavar="ORG", help="only if it belongs to this org")
    p.set_defaults(handler=cmd_show)

    for action, statuses, help_text, status_help in (
        (
            "retry",
            admin_queue.RETRYABLE,
            "make deferred, bounced or expired recipients due now",
            "which recipients: deferred, stale (delivering, but its lease ran out: nobody holds "
            "it), bounced, expired (repeatable; by filter the default is deferred and stale, "
            "by id all four)",
        ),
        (
            "cancel",
            admin_queue.CANCELLABLE,
            "stop delivering queued recipients",
            "which recipients: queued (everything waiting, the default), deferred, or stale "
            "(delivering, but its lease ran out)",
        ),
    ):
        p = commands.add_parser(action, help=help_text)
        add_common(p)
        p.add_argument("ids", nargs="*", metavar="ID", help="queue ids or recipient ids")
        _add_filters(p, statuses, status_help=status_help)
        p.add_argument("--all", action="store_true", help="every such recipient (no filter)")
        p.add_argument(
            "--dry-run", action="store_true", help="only print how many rows would be touched"
        )
        p.set_defaults(handler=cmd_action, action=action)
    suspend.register(commands)


def _add_filters(
    p: argparse.ArgumentParser, statuses: tuple[str, ...], status_help: str | None = None
) -> None:
    p.add_argument(
        "--status",
        action="append",
        choices=[str(s) for s in statuses],
        metavar="S",
        help=status_help or f"status (repeatable): {', '.join(str(s) for s in statuses)}",
    )
    p.add_argument("--domain", metavar="D", help="recipient domain")
    p.add_argument("--org", metavar="O", help="only this org")
    p.add_argument("--lane", metavar="NAME", help="only this lane")
    p.add_argument("--older-than", metavar="DUR", help="queued longer ago than DUR (e.g. 2h)")


async def _selection(conn: Any, args: argparse.Namespace, ids: tuple[uuid.UUID, ...]) -> Selection:
    older_than = None
    if args.older_than:
        try:
            older_than = float(Duration.parse(args.older_than))
        except ValueError as exc:
            raise CliError(f"--older-than: {exc}") from None
    statuses = tuple(args.status or ())
    if "all" in statuses:
        statuses = tuple(str(s) for s in admin_queue.LISTABLE if s != admin_queue.DEFERRED)
    return Selection(
        statuses=statuses,
        domain=args.domain,
        org_id=await org_named(conn, args.org) if args.org else None,
        older_than=older_than,
        ids=ids,
        lane=args.lane,
    )


def _ids(values: list[str]) -> tuple[uuid.UUID, ...]:
    try:
        return tuple(uuid.UUID(v) for v in values)
    except ValueError:
        bad = next(v for v in values if not _is_uuid(v))
        raise CliError(f"'{bad}' is not a queue id or recipient id") from None


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- summary


async def cmd_summary(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn):
        summary = await admin_queue.queue_summary(conn, top=args.top, exact=args.exact)
        budgets = await store_budgets.list_budgets(conn)
        suspended = await suspensions.list_suspensions(conn)
    lanes = lane_rows(summary, settings.lanes)
    if args.json:
        data = {**summary_object(summary), "lanes": lanes}
        data["budgets"] = [dataclasses.asdict(b) for b in budgets]
        data["suspensions"] = [dataclasses.asdict(s) for s in suspended]
        print(json.dumps(jsonable(data), indent=2))
        return 0
    print_rows(args, summary_rows(summary), ["status", "recipients"])
    print()
    if summary.due:
        print(f"oldest due recipient has waited {format_age(summary.oldest_due_age)}")
    else:
        print("nothing is due")
    if summary.estimated:
        print("(~ marks estimates from table statistics; --exact counts them)")
    print()
    print_rows(
        args,
        [{**lane, "oldest_due": format_age(lane["oldest_due_age_seconds"])} for lane in lanes],
        ["lane", "queued", "due", "deferred", "delivering", "oldest_due"],
    )
    print()
    print_rows(
        args,
        [
            {
                "destination": d.domain,
                "deferred": d.deferred,
                "latest_reply": _short(_reply(d.last_code, d.last_enhanced_code, d.last_response)),
                "at": d.last_at,
            }
            for d in summary.top_deferred
        ],
        ["destination", "deferred", "latest_reply", "at"],
    )
    if budgets:
        print()
        print_rows(args, [budget_row(b) for b in budgets], BUDGET_COLUMNS)
    if suspended:
        print()
        suspend.print_suspensions(args, suspended)
    return 0


BUDGET_COLUMNS = [
    "budget",
    "rate",
    "effective_rate",
    "concurrency",
    "effective",
    "sessions",
    "waiting",
    "state",
    "throttling_reply",
]


def budget_row(b: store_budgets.BudgetState) -> dict[str, Any]:
    """A limited destination, lane or org: configured and effective limits, backoff state."""
    kind = b.key.split(":", 1)[0]
    name = b.name
    source = store_budgets.DEFAULT_SOURCE
    if b.key.startswith(store_budgets.DESTINATION):
        # A destination's key names a pattern entry, a site (its MX hosts) or a route, as seen
        # from an egress source.
        source, name = store_budgets.source_and_site(b.key)
        if name.startswith("site:"):
            kind = "site"
    name = name.removeprefix("pattern:").removeprefix("mx:").removeprefix("site:")
    if source != store_budgets.DEFAULT_SOURCE:
        name += f" from {source}"
    state = "ok"
    if b.parked_until is not None:
        state = f"parked, probe at {_clock(b.parked_until)}: {_short(b.parked_reason or '')}"
    elif b.capped and not b.backoff:
        state = "capped where it throttled us (no limits configured)"
    elif b.backoff:
        state = f"backing off since {_clock(b.throttled_at)}"
        if b.held_until is not None and b.held_until > datetime.now(UTC):
            state += f", held until {_clock(b.held_until)}"
    return {
        "budget": f"{kind} {name}",
        "rate": _limit(b.rate),
        "effective_rate": _limit(b.effective_rate),
        "concurrency": _limit(b.concurrency),
        "effective": _limit(b.effective_concurrency),
        "sessions": b.sessions,
        "waiting": b.waiting,
        "state": state,
        "throttling_reply": _short(b.last_reply) if b.backoff and b.last_reply else "-",
    }


def _limit(value: float) -> str:
    return f"{value:g}" if value > 0 else "-"


def _clock(when: datetime | None) -> str:
    return when.astimezone(UTC).strftime("%H:%M:%S") if when else "?"


def summary_rows(summary: admin_queue.QueueSummary) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for status, count in summary.counts.items():
        shown = f"~{count}" if status in summary.estimated else str(count)
        rows.append({"status": status, "recipients": shown})
        if status == "queued":
            rows.append({"status": "  due now", "recipients": str(summary.due)})
            rows.append({"status": "  deferred", "recipients": str(summary.deferred)})
    return rows


def lane_rows(summary: admin_queue.QueueSummary, configured: Iterable[str]) -> list[dict[str, Any]]:
    """The live queue of each lane: the configured lanes (with no mail, zeros) and any lane that
    queued mail still carries after the settings dropped it. "queued" counts the deferred too."""
    by_lane = {lane.lane: lane for lane in summary.lanes}
    return [
        {
            "lane": name,
            "queued": lane.queued if lane else 0,
            "due": lane.due if lane else 0,
            "deferred": lane.deferred if lane else 0,
            "delivering": lane.delivering if lane else 0,
            "oldest_due_age_seconds": round(lane.oldest_due_age, 3) if lane else 0.0,
        }
        for name in sorted({*configured, *by_lane})
        for lane in [by_lane.get(name)]
    ]


def summary_object(summary: admin_queue.QueueSummary) -> dict[str, Any]:
    return {
        "counts": summary.counts,
        "estimated": sorted(summary.estimated),
        "due": summary.due,
        "deferred": summary.deferred,
        "oldest_due_age_seconds": round(summary.oldest_due_age, 3),
        "top_deferred_destinations": [
            {
                "domain": d.domain,
                "deferred": d.deferred,
                "latest_reply": _reply(d.last_code, d.last_enhanced_code, d.last_response),
                "code": d.last_code,
                "enhanced_code": d.last_enhanced_code,
                "response": d.last_response,
                "at": d.last_at,
            }
            for d in summary.top_deferred
        ],
    }


# ---------------------------------------------------------------- list / show

LIST_COLUMNS = [
    "id",
    "queue_id",
    "status",
    "lane",
    "attempts",
    "next_attempt_at",
    "address",
    "last_reply",
]


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        selection = await _selection(conn, args, ())
        rows = await admin_queue.list_recipients(conn, selection, limit=args.limit)
    print_rows(args, [_recipient(r, full=args.json) for r in rows], LIST_COLUMNS)
    if len(rows) == args.limit and not args.json:
        eprint(f"(showing the first {args.limit}; use --limit for more)")
    return 0


def _recipient(row: admin_queue.RecipientRow, *, full: bool) -> dict[str, Any]:
    data = dataclasses.asdict(row)
    data["last_reply"] = row.last_reply if full else _short(row.last_reply)
    return data


async def cmd_show(args: argparse.Namespace) -> int:
    (ref,) = _ids([args.id])
    async with open_database(args) as (_settings, conn):
        org_id = await org_named(conn, args.org) if args.org else None
        try:
            detail = await admin_queue.show(conn, ref, org_id=org_id)
        except LookupError as exc:
            raise CliError(str(exc)) from None
    if args.json:
        data = dataclasses.asdict(detail)
        data["recipients"] = [_recipient(r, full=True) for r in detail.recipients]
        print(json.dumps(jsonable(data), indent=2))
        return 0
    fields = dataclasses.asdict(detail)
    del fields["recipients"], fields["attempts"]
    print_object(args, fields)
    print()
    print_rows(
        args,
        [_recipient(r, full=False) for r in detail.recipients],
        [
            "id",
            "address",
            "status",
            "attempts",
            "next_attempt_at",
            "lease_owner",
            "delay_warned_at",
            "last_reply",
        ],
    )
    if detail.attempts:
        print()
        for attempt in detail.attempts:
            attempt["reply"] = _short(
                _reply(attempt["code"], attempt["enhanced_code"], attempt["response"])
            )
        print_rows(
            args,
            detail.attempts,
            ["attempt", "started_at", "outcome", "mx_host", "category", "reply"],
        )
    return 0


# ---------------------------------------------------------------- retry / cancel


async def cmd_action(args: argparse.Namespace) -> int:
    ids = _ids(args.ids)
    filtered = args.status or args.domain or args.org or args.lane or args.older_than
    if not (ids or filtered or args.all):
        raise CliError(
            f"say which recipients to {args.action}: queue or recipient ids, a filter "
            "(--status, --domain, --org, --lane, --older-than), or --all"
        )
    statuses = args.status
    if not statuses and not ids and args.action == "retry":
        # By filter, retry only what is waiting to retry, and what a lease that ran out left.
        statuses = [admin_queue.DEFERRED, admin_queue.STALE]
    args.status = statuses
    async with open_database(args) as (_settings, conn):
        selection = await _selection(conn, args, ids)
        unknown = await admin_queue.unknown_ids(conn, ids, org_id=selection.org_id)
        if unknown:
            where = f" in org '{args.org}'" if args.org else ""
            raise CliError(
                f"no message or recipient{where} has the id {', '.join(map(str, unknown))}; "
                f"nothing was {'retried' if args.action == 'retry' else 'cancelled'}"
            )
        try:
            result = await admin_queue.bulk_action(
                conn, args.action, selection, dry_run=args.dry_run
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.json:
        print(
            json.dumps(
                {
                    "action": result.action,
                    "dry_run": result.dry_run,
                    "count": result.count,
                    "delivering_left_alone": result.delivering,
                }
            )
        )
        return 0
    done = {"retry": "retried", "cancel": "cancelled"}[result.action]
    if result.dry_run:
        print(f"would {result.action} {result.count} recipient(s) (dry run; nothing changed)")
    else:
        print(f"{done} {result.count} recipient(s)")
    if result.delivering:
        print(
            f"{result.delivering} matching recipient(s) are being delivered right now and "
            f"{'would be' if result.dry_run else 'were'} left alone; their attempt decides "
            "their state (run the command again once it is recorded)"
        )
    return 0


def _reply(code: int | None, enhanced: str | None, text: str | None) -> str | None:
    return " ".join(str(p) for p in (code, enhanced, text) if p) or None


def _short(text: str | None) -> str:
    cell = text_cell(text)
    return cell if len(cell) <= REPLY_WIDTH else cell[: REPLY_WIDTH - 1] + "…"
