"""`org add`, `org list`."""

from __future__ import annotations

import argparse
from typing import Any

from pigeon_mta.commands.common import CliError, add_common, open_database, print_object, print_rows
from pigeon_mta.store import orgs as store_orgs


def register(sub: Any) -> None:
    org = sub.add_parser("org", help="tenants").add_subparsers(dest="org_command", required=True)
    p = org.add_parser("add", help="create an org")
    add_common(p)
    p.add_argument("name")
    p.set_defaults(handler=cmd_add)
    p = org.add_parser("list", help="list orgs")
    add_common(p)
    p.set_defaults(handler=cmd_list)


async def cmd_add(args: argparse.Namespace) -> int:
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
    print_rows(args, [vars(o) for o in orgs], ["name", "id", "created_at"])
    return 0
