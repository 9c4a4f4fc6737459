"""`org add`, `org list`, `org show`, `org set`, `org pause`, `org resume`, `org remove`."""

from __future__ import annotations

import argparse
import math
from typing import Any

import asyncpg

from pigeon_mta.commands.common import CliError, add_common, open_database, print_object, print_rows
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store import reputation as store_reputation
from pigeon_mta.store import suspensions

MAX_ORG_NAME = 100


def register(sub: Any) -> None:
    org = sub.add_parser("org", help="tenants").add_subparsers(dest="org_command", required=True)
    p = org.add_parser("add", help="create an org")
    add_common(p)
    p.add_argument("name")
    p.set_defaults(handler=cmd_add)
    p = org.add_parser("list", help="list orgs")
    add_common(p)
    p.set_defaults(handler=cmd_list)
    p = org.add_parser("set", help="change an org's settings")
    add_common(p)
    p.add_argument("name")
    p.add_argument(
        "--rate",
        required=True,
        metavar="N",
        help="messages per second the org sends, all its nodes and processes together (0 = none)",
    )
    p.set_defaults(handler=cmd_set)
    p = org.add_parser("show", help="an org, its bounce and complaint rates, whether it is paused")
    add_common(p)
    p.add_argument("name")
    p.set_defaults(handler=cmd_show)
    p = org.add_parser("pause", help="stop attempting the org's mail until `org resume`")
    add_common(p)
    p.add_argument("name")
    p.add_argument("--reason", default="paused by an operator", help="shown by queue and log")
    p.set_defaults(handler=cmd_pause)
    p = org.add_parser("resume", help="attempt the mail of a paused org again")
    add_common(p)
    p.add_argument("name")
    p.set_defaults(handler=cmd_resume)
    p = org.add_parser(
        "remove",
        help="delete an org with its users, domains, DKIM keys, suppression list and mail",
    )
    add_common(p)
    p.add_argument("name")
    p.add_argument(
        "--force",
        action="store_true",
        help="also when mail is queued or being delivered: that mail is deleted, not delivered",
    )
    p.set_defaults(handler=cmd_remove)


def check_org_name(name: str) -> None:
    """A name that prints on one line as itself: `org list` is read by people and scripts."""
    if not name or len(name) > MAX_ORG_NAME:
        raise CliError(f"an org name must have 1 to {MAX_ORG_NAME} characters")
    if name != name.strip() or not name.isprintable():
        raise CliError(
            f"the org name {name!r} contains control characters, line breaks or white space at "
            "its ends"
        )


async def cmd_add(args: argparse.Namespace) -> int:
    check_org_name(args.name)
    async with open_database(args) as (_settings, conn):
        try:
            org = await store_orgs.add_org(conn, args.name)
        except store_orgs.OrgExists as exc:
            raise CliError(str(exc)) from None
    print_object(args, {"id": org.id, "name": org.name, "created_at": org.created_at})
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        orgs = await store_orgs.list_orgs(conn)
    print_rows(args, [vars(o) for o in orgs], ["name", "id", "rate", "created_at"])
    return 0


def parse_rate(text: str) -> float:
    """A rate in messages per second: a finite number, not negative."""
    try:
        rate = float(text)
    except ValueError:
        raise CliError(f"--rate: {text!r} is not a number of messages per second") from None
    if not math.isfinite(rate) or rate < 0 or rate > 1e9:
        raise CliError(f"--rate: {text!r} must be 0 (no limit) or a positive number up to 1e9")
    return rate


async def cmd_show(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn):
        org = await _org(conn, args.name)
        [rates] = await store_reputation.rates(
            conn, window=settings.reputation.window, org_id=org.id
        )
        lanes = await store_reputation.lane_rates(conn, org.id, window=settings.reputation.window)
    reputation = settings.reputation
    print_object(
        args,
        {
            "org": rates.org,
            "id": rates.org_id,
            "window": store_reputation.window_text(reputation.window),
            "sent": rates.sent,
            "hard_bounces": rates.bounced,
            "bounce_rate": round(rates.bounce_rate, 6),
            "complaints": rates.complained,
            "complaint_rate": round(rates.complaint_rate, 6),
            "pause_bounce_rate": reputation.pause_bounce_rate,
            "pause_complaint_rate": reputation.pause_complaint_rate,
            "paused": rates.paused,
            "resumed_at": rates.resumed_at,
            **({"lanes": [_lane(lane) for lane in lanes]} if args.json else {}),
        },
    )
    if lanes and not args.json:
        print()
        print_rows(args, [_lane(lane) for lane in lanes], list(_lane(lanes[0])))
    return 0


def _lane(lane: store_reputation.LaneRates) -> dict[str, object]:
    return {
        "lane": lane.lane,
        "sent": lane.sent,
        "hard_bounces": lane.bounced,
        "bounce_rate": round(lane.bounce_rate, 6),
        "complaints": lane.complained,
        "complaint_rate": round(lane.complaint_rate, 6),
    }


async def cmd_pause(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        org = await _org(conn, args.name)
        await suspensions.suspend(
            conn, suspensions.ORG + str(org.id), reason=args.reason, seconds=None
        )
    print_object(args, {"org": org.name, "paused": args.reason})
    return 0


async def cmd_resume(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        org = await _org(conn, args.name)
        ended = await suspensions.resume(conn, suspensions.ORG + str(org.id))
        await store_reputation.mark_resumed(conn, org.id)
    if not ended:
        raise CliError(f"org '{org.name}' is not paused")
    print_object(args, {"org": org.name, "resumed": True})
    return 0


async def _org(conn: asyncpg.Connection, name: str) -> store_orgs.Org:
    org = await store_orgs.find_org(conn, name)
    if org is None:
        raise CliError(f"there is no org '{name}'")
    return org


async def cmd_set(args: argparse.Namespace) -> int:
    rate = parse_rate(args.rate)
    async with open_database(args) as (_settings, conn):
        org = await store_orgs.set_org_rate(conn, args.name, rate)
    if org is None:
        raise CliError(f"there is no org '{args.name}'")
    print_object(args, {"org": org.name, "id": org.id, "rate": org.rate})
    return 0


async def cmd_remove(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn):
        if args.name == settings.relay.trusted_org:
            raise CliError(
                f"org '{args.name}' is relay.trusted_org in the config (mail from trusted "
                "networks belongs to it); name another org there first"
            )
        try:
            removed = await store_orgs.remove_org(conn, args.name, force=args.force)
        except store_orgs.OrgBusy as exc:
            raise CliError(
                f"org '{args.name}' has {exc.waiting} recipient(s) queued or being delivered; "
                "wait for them, cancel them (pigeon-mta queue cancel --org ORG), or use --force "
                "to delete them undelivered"
            ) from None
        except asyncpg.ForeignKeyViolationError as exc:
            raise CliError(f"org '{args.name}' is still referenced: {exc.detail}") from None
    if removed is None:
        raise CliError(f"there is no org '{args.name}'")
    print_object(
        args,
        {
            "org": removed.org.name,
            "id": removed.org.id,
            "users": removed.users,
            "domains": removed.domains,
            "dkim_keys": removed.dkim_keys,
            "suppressions": removed.suppressions,
            "messages": removed.messages,
            "undelivered_recipients": removed.waiting,
        },
    )
    return 0
