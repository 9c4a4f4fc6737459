"""`queue` (its summary: commands/queue_summary.py), `queue list`, `queue show`, `queue retry`, `queue cancel`; `queue suspend`
and `queue resume` are in commands/suspend.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import uuid
from typing import Any

from pigeon_mta.commands import queue_summary, suspend
from pigeon_mta.commands.common import (
    CliError,
    add_common,
    eprint,
    jsonable,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.commands.queue_summary import reply_text, short_reply
from pigeon_mta.commands.suppress import org_named
from pigeon_mta.config import Duration
from pigeon_mta.store import admin_queue
from pigeon_mta.store.admin_queue import Selection


def register(sub: Any) -> None:
    queue = sub.add_parser("queue", help="queue summary and administration")
    add_common(queue)
    queue.add_argument("--top", type=int, default=10, metavar="N", help="destinations shown (10)")
    queue.add_argument(
        "--exact",
        action="store_true",
        help="count finished recipients exactly (a full table scan) instead of estimating",
    )
    queue.set_defaults(handler=queue_summary.cmd_summary)
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
    data["last_reply"] = row.last_reply if full else short_reply(row.last_reply)
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
            attempt["reply"] = short_reply(
                reply_text(attempt["code"], attempt["enhanced_code"], attempt["response"])
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
