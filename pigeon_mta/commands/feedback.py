"""`feedback list`, `feedback show ID`, `feedback rotate-key`: what came back to the feedback
listeners (bounces after acceptance, complaint reports) and what became of it; the key of the
return-path tokens."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from pigeon_mta.commands.common import (
    CliError,
    add_common,
    eprint,
    format_age,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.store import feedback as store_feedback
from pigeon_mta.store import return_path as store_return_path
from pigeon_mta.store.executor import transaction

SHOWN_BODY = 64 * 1024  # `feedback show` prints this much of a message; --json gives it whole


def register(sub: Any) -> None:
    feedback = sub.add_parser(
        "feedback", help="bounces and complaint reports that came back"
    ).add_subparsers(dest="feedback_command", required=True)
    p = feedback.add_parser("list", help="the newest feedback messages and what became of them")
    add_common(p)
    p.add_argument("--status", choices=store_feedback.STATUSES, help="only these")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="at most N (50)")
    p.set_defaults(handler=cmd_list)
    p = feedback.add_parser("show", help="one feedback message: as it came, and its events")
    add_common(p)
    p.add_argument("id", metavar="ID")
    p.set_defaults(handler=cmd_show)
    p = feedback.add_parser(
        "rotate-key",
        help="sign new return-path tokens with a new key (the old one verifies for "
        "bounces.feedback_max_age more)",
    )
    add_common(p)
    p.set_defaults(handler=cmd_rotate)


async def cmd_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise CliError("--limit must be at least 1")
    async with open_database(args) as (_settings, conn):
        kept = await store_feedback.list_kept(conn, status=args.status, limit=args.limit)
    rows = [
        {**vars(k), "rcpt_to": ", ".join(k.rcpt_to), "mail_from": k.mail_from or "<>"} for k in kept
    ]
    print_rows(
        args, rows, ["id", "received_at", "status", "kind", "mail_from", "rcpt_to", "detail"]
    )
    return 0


async def cmd_show(args: argparse.Namespace) -> int:
    try:
        feedback_id = uuid.UUID(args.id)
    except ValueError:
        raise CliError(f"'{args.id}' is not a feedback id") from None
    async with open_database(args) as (_settings, conn):
        found = await store_feedback.show_kept(conn, feedback_id)
    if found is None:
        raise CliError(f"no feedback message {feedback_id}")
    kept, body, events = found
    if args.json:
        print_object(
            args,
            {
                **vars(kept),
                "events": [vars(e) for e in events],
                "body": body.decode("utf-8", "replace"),
            },
        )
        return 0
    print_object(args, {**vars(kept), "rcpt_to": ", ".join(kept.rcpt_to)})
    if events:
        print()
        print_rows(
            args,
            [vars(e) for e in events],
            [
                "recorded_at",
                "kind",
                "hard",
                "address",
                "code",
                "enhanced_code",
                "category",
                "changed_state",
                "queue_id",
            ],
        )
    print()
    text = body[:SHOWN_BODY].decode("utf-8", "replace")
    print(text.replace("\r\n", "\n"))
    if len(body) > SHOWN_BODY:
        eprint(f"(the first {SHOWN_BODY} of {len(body)} bytes; --json prints it whole)")
    return 0


async def cmd_rotate(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn), transaction(conn) as tx:
        key_id = await store_return_path.rotate_key(tx)
    print_object(
        args,
        {
            "key": key_id,
            "note": "new mail is signed with it once each node refreshes (within 30 s); the "
            f"old key verifies for {format_age(settings.bounces.feedback_max_age)} more",
        },
    )
    return 0
