"""`suppress add|remove|list`: the per-org list of addresses that must not be mailed."""

from __future__ import annotations

import argparse
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from pigeon_mta.commands.common import CliError, add_common, eprint, open_database, print_rows
from pigeon_mta.config import Duration
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store import suppression as store_suppression

COLUMNS = ["address", "org", "source", "reason", "created_at", "expires_at"]


def register(sub: Any) -> None:
    suppress = sub.add_parser("suppress", help="suppression list").add_subparsers(
        dest="suppress_command", required=True
    )
    p = suppress.add_parser("add", help="stop mail to addresses (of one org)")
    add_common(p)
    p.add_argument("org", metavar="ORG")
    p.add_argument("addresses", nargs="+", metavar="ADDRESS")
    p.add_argument("--reason", default="added by hand", help="why (shown by suppress list)")
    p.add_argument(
        "--expires",
        metavar="WHEN",
        help="a duration from now (30d, 12h) or a date (2030-01-31); default: never",
    )
    p.set_defaults(handler=cmd_add)

    p = suppress.add_parser("remove", help="allow mail to addresses again")
    add_common(p)
    p.add_argument("org", metavar="ORG")
    p.add_argument("addresses", nargs="+", metavar="ADDRESS")
    p.set_defaults(handler=cmd_remove)

    p = suppress.add_parser("list", help="list suppressed addresses")
    add_common(p)
    p.add_argument("org", nargs="?", metavar="ORG", help="only this org (default: every org)")
    p.add_argument("--expired", action="store_true", help="include entries that have expired")
    p.add_argument("--limit", type=int, default=1000, metavar="N", help="at most N (1000)")
    p.set_defaults(handler=cmd_list)


async def cmd_add(args: argparse.Namespace) -> int:
    expires_at = parse_expiry(args.expires) if args.expires else None
    addresses = [checked_address(a) for a in args.addresses]
    rows = []
    async with open_database(args) as (_settings, conn):
        org_id = await org_named(conn, args.org)
        async with conn.transaction():
            for address in addresses:
                entry, _new = await store_suppression.add_suppression(
                    conn, org_id, address, reason=args.reason, expires_at=expires_at
                )
                rows.append(_row(entry, args.org))
    print_rows(args, rows, COLUMNS)
    return 0


async def cmd_remove(args: argparse.Namespace) -> int:
    addresses = [checked_address(a) for a in args.addresses]
    missing = []
    removed = []
    async with open_database(args) as (_settings, conn):
        org_id = await org_named(conn, args.org)
        for address in addresses:
            if await store_suppression.remove_suppression(conn, org_id, address):
                removed.append({"address": address, "org": args.org})
            else:
                missing.append(address)
    if removed or args.json:
        print_rows(args, removed, ["address", "org"])
    if missing:
        raise CliError(f"not on the suppression list of org '{args.org}': {', '.join(missing)}")
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        org_id = await org_named(conn, args.org) if args.org else None
        names = {o.id: o.name for o in await store_orgs.list_orgs(conn)}
        entries = await store_suppression.list_suppressions(
            conn, org_id, include_expired=args.expired, limit=args.limit
        )
    print_rows(args, [_row(e, names.get(e.org_id, str(e.org_id))) for e in entries], COLUMNS)
    if len(entries) == args.limit and not args.json:
        eprint(f"(showing the first {args.limit}; use --limit for more)")
    return 0


def _row(entry: store_suppression.Suppression, org: str) -> dict[str, Any]:
    return {
        "address": entry.address,
        "org": org,
        "source": entry.source,
        "reason": entry.reason,
        "attempt_id": entry.attempt_id,
        "created_at": entry.created_at,
        "expires_at": entry.expires_at,
    }


async def org_named(conn: asyncpg.Connection, name: str) -> uuid.UUID:
    org = await store_orgs.find_org(conn, name)
    if org is None:
        raise CliError(f"there is no org named '{name}' (see pigeon-mta org list)")
    return org.id


def checked_address(text: str) -> str:
    address = store_suppression.normalise_address(text)
    if not store_suppression.looks_like_address(address):
        raise CliError(f"'{text}' is not an email address")
    return address


def parse_expiry(text: str) -> datetime:
    """A duration from now ("30d") or an ISO date/time (UTC unless it says otherwise)."""
    try:
        return datetime.now(UTC) + timedelta(seconds=Duration.parse(text))
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(
            f"--expires {text!r} is neither a duration like 30d nor a date like 2030-01-31"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)
