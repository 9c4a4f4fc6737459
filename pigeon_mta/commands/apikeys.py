"""`apikey add|list|revoke`: the keys applications present to the HTTP API.

A key is shown once, by `apikey add`; only its hash is stored (store/apikeys.py).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from pigeon_mta.commands.common import (
    CliError,
    add_common,
    checked_lane,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import orgs as store_orgs

MAX_NAME = 200


def register(sub: Any) -> None:
    apikey = sub.add_parser("apikey", help="API keys of the HTTP API").add_subparsers(
        dest="apikey_command", required=True
    )
    p = apikey.add_parser("add", help="create a key for an org (printed once)")
    add_common(p)
    p.add_argument("org")
    p.add_argument("--name", default="", help="what the key is for (shown by apikey list)")
    p.add_argument("--lane", metavar="NAME", help="the lane of its mail unless a request names one")
    p.set_defaults(handler=cmd_add)
    p = apikey.add_parser("list", help="list keys (of one org)")
    add_common(p)
    p.add_argument("org", nargs="?")
    p.set_defaults(handler=cmd_list)
    p = apikey.add_parser("revoke", help="refuse a key (in every process within api.auth_cache)")
    add_common(p)
    p.add_argument("id", help="the key's id (apikey list shows it)")
    p.set_defaults(handler=cmd_revoke)


async def cmd_add(args: argparse.Namespace) -> int:
    if len(args.name) > MAX_NAME or not args.name.isprintable():
        raise CliError(f"--name must be at most {MAX_NAME} printable characters")
    async with open_database(args) as (settings, conn):
        lane = checked_lane(settings, args.lane) if args.lane is not None else None
        org = await store_orgs.find_org(conn, args.org)
        if org is None:
            raise CliError(
                f"there is no org '{args.org}' (create it with: pigeon-mta org add NAME)"
            )
        key, secret = await store_apikeys.add_api_key(conn, org.id, name=args.name, lane=lane)
    print_object(
        args,
        {"id": key.id, "key": secret}
        if args.json
        else {"id": key.id, "org": key.org, "name": key.name, "lane": key.lane, "key": secret},
    )
    if not args.json:
        print("(the key is shown only this once: store it now)", file=sys.stderr)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        org_id = None
        if args.org is not None:
            org = await store_orgs.find_org(conn, args.org)
            if org is None:
                raise CliError(f"there is no org '{args.org}'")
            org_id = org.id
        keys = await store_apikeys.list_api_keys(conn, org_id)
    print_rows(
        args,
        [
            {k: v for k, v in vars(key).items() if k != "org_id"}
            | {"revoked": bool(key.revoked_at)}
            for key in keys
        ],
        ["id", "org", "name", "lane", "created_at", "last_used_at", "revoked", "revoked_at"],
    )
    return 0


async def cmd_revoke(args: argparse.Namespace) -> int:
    try:
        key_id = uuid.UUID(args.id)
    except ValueError:
        raise CliError(f"'{args.id}' is not a key id (apikey list shows them)") from None
    async with open_database(args) as (_settings, conn):
        key = await store_apikeys.revoke_api_key(conn, key_id)
    if key is None:
        raise CliError(f"there is no API key {key_id}")
    print_object(
        args, {"id": key.id, "org": key.org, "name": key.name, "revoked_at": key.revoked_at}
    )
    return 0
