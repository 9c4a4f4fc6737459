"""`pigeon-mta queue suspend|resume`: stop attempting the mail of a site, a domain, an org or a
lane, for a while or until resumed (store/suspensions.py).

A site is named as `queue` lists it: its MX host names ("mx1.example.net,mx2.example.net", in any
order), `pattern:PATTERN` for a `[delivery.destination]` entry, `route:HOST:PORT` for a static
route, or `relayhost`. `--site` with `--org` names that org's mail to the site: the key a
reply's stated retry delay holds (`by: reply` in `queue`), which `resume` ends early, and which an
operator may suspend as well.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pigeon_mta.commands.common import (
    CliError,
    add_common,
    checked_lane,
    jsonable,
    open_database,
    print_rows,
)
from pigeon_mta.commands.suppress import org_named
from pigeon_mta.config import Duration, Settings
from pigeon_mta.domains import ascii_domain
from pigeon_mta.outbound.mx import site_of
from pigeon_mta.store import suspensions


def register(commands: Any) -> None:
    """The two subcommands, under `queue`."""
    for name, help_text in (
        ("suspend", "stop attempting a site's, domain's, org's or lane's mail"),
        ("resume", "end a suspension: the mail is delivered again"),
    ):
        p = commands.add_parser(name, help=help_text)
        add_common(p)
        p.add_argument(
            "--site",
            metavar="SITE",
            help="MX host names (a,b), pattern:PATTERN, route:HOST:PORT or relayhost",
        )
        p.add_argument("--domain", metavar="D", help="a recipient domain")
        p.add_argument("--org", metavar="ORG", help="an org (with --site: its mail to the site)")
        p.add_argument("--lane", metavar="NAME", help="a lane")
        if name == "suspend":
            p.add_argument(
                "--for", dest="duration", metavar="DUR", help="for this long (e.g. 30m, 2h)"
            )
            p.add_argument("--reason", default="", metavar="TEXT", help="shown in queue and in log")
            p.set_defaults(handler=cmd_suspend)
        else:
            p.set_defaults(handler=cmd_resume)


def site_key(value: str) -> str:
    value = value.strip()
    if value.startswith(("pattern:", "route:")) or value == "relayhost":
        return suspensions.SITE + value
    hosts = [h for h in value.split(",") if h.strip()]
    if not hosts:
        raise CliError("--site: name the site's MX hosts, pattern:..., route:... or relayhost")
    return suspensions.SITE + site_of(h.strip() for h in hosts)


async def _key(conn: Any, settings: Settings, args: argparse.Namespace) -> str:
    given = [n for n in ("site", "domain", "org", "lane") if getattr(args, n) is not None]
    if given == ["site", "org"]:
        return suspensions.hold_key(site_key(args.site), await org_named(conn, args.org))
    if len(given) != 1:
        raise CliError(
            "name one of --site, --domain, --org or --lane (or --site with --org: that org's "
            "mail to the site)"
        )
    if args.site is not None:
        return site_key(args.site)
    if args.domain is not None:
        try:
            return suspensions.DOMAIN + ascii_domain(args.domain.strip().rstrip(".")).lower()
        except ValueError as exc:
            raise CliError(f"--domain: {exc}") from None
    if args.org is not None:
        return suspensions.ORG + str(await org_named(conn, args.org))
    return suspensions.LANE + checked_lane(settings, args.lane)


def _seconds(duration: str | None) -> float | None:
    if duration is None:
        return None
    try:
        seconds = float(Duration.parse(duration))
    except ValueError as exc:
        raise CliError(f"--for: {exc}") from None
    if seconds <= 0:
        raise CliError("--for must be longer than zero")
    return seconds


async def cmd_suspend(args: argparse.Namespace) -> int:
    seconds = _seconds(args.duration)
    reason = " ".join(args.reason.split()) or "no reason given"
    async with open_database(args) as (settings, conn):
        key = await _key(conn, settings, args)
        await suspensions.suspend(conn, key, reason=reason, seconds=seconds)
        [shown] = [s for s in await suspensions.list_suspensions(conn) if s.key == key]
    if args.json:
        print(
            json.dumps(jsonable({"suspended": key, "until": shown.until, "queued": shown.waiting}))
        )
    else:
        until = f"until {shown.until:%Y-%m-%d %H:%M:%S} UTC" if shown.until else "until resumed"
        print(f"suspended {key} {until}: {shown.waiting} queued recipient(s) wait, unattempted")
    return 0


async def cmd_resume(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn):
        key = await _key(conn, settings, args)
        if not await suspensions.resume(conn, key):
            raise CliError(f"{key} is not suspended (see pigeon-mta queue)")
    if args.json:
        print(json.dumps({"resumed": key}))
    else:
        print(f"resumed {key}: its mail is delivered again")
    return 0


def print_suspensions(args: argparse.Namespace, rows: list[suspensions.Suspension]) -> None:
    """The suspensions in force, as `queue` shows them."""
    print_rows(
        args,
        [
            {
                "suspended": s.key,
                "until": f"{s.until:%Y-%m-%d %H:%M:%S}" if s.until else "resumed",
                "waiting": s.waiting,
                "by": s.kind,
                "reason": s.reason,
            }
            for s in rows
        ],
        ["suspended", "until", "waiting", "by", "reason"],
    )
