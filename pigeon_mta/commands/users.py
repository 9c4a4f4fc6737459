"""`user add ORG USERNAME [--password-stdin]`, `user list`, `user disable USERNAME`: SMTP AUTH users."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from pigeon_mta.commands.common import CliError, add_common, open_database, print_object, print_rows
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.store import orgs as store_orgs

MAX_USERNAME = 255


def register(sub: Any) -> None:
    user = sub.add_parser("user", help="SMTP AUTH users").add_subparsers(
        dest="user_command", required=True
    )
    p = user.add_parser(
        "add", help="create a user (a strong password is generated unless --password-stdin)"
    )
    add_common(p)
    p.add_argument("org")
    p.add_argument("username")
    p.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the password from standard input instead of generating one",
    )
    p.set_defaults(handler=cmd_add)
    p = user.add_parser("list", help="list users")
    add_common(p)
    p.set_defaults(handler=cmd_list)
    p = user.add_parser("disable", help="refuse a user's AUTH from now on")
    add_common(p)
    p.add_argument("username")
    p.set_defaults(handler=cmd_disable)


def _check_username(username: str) -> None:
    if not username or len(username) > MAX_USERNAME:
        raise CliError(f"a username must have 1 to {MAX_USERNAME} characters")
    if any(c.isspace() or not c.isprintable() for c in username):
        raise CliError("a username cannot contain spaces or control characters")


def _read_password() -> str:
    text = sys.stdin.read()
    password = text[:-1] if text.endswith("\n") else text
    password = password[:-1] if password.endswith("\r") else password
    if not password:
        raise CliError("no password on standard input")
    if "\n" in password or "\0" in password:
        raise CliError("the password on standard input must be one line")
    return password


async def cmd_add(args: argparse.Namespace) -> int:
    _check_username(args.username)
    generated = not args.password_stdin
    password = store_credentials.generate_password() if generated else _read_password()
    password_hash = await asyncio.to_thread(store_credentials.hash_password, password)
    async with open_database(args) as (_settings, conn):
        org = await store_orgs.find_org(conn, args.org)
        if org is None:
            raise CliError(
                f"there is no org '{args.org}' (create it with: pigeon-mta org add NAME)"
            )
        try:
            user = await store_credentials.add_credential(
                conn, org.id, args.username, password_hash
            )
        except store_credentials.CredentialExists as exc:
            raise CliError(str(exc)) from None
    shown: dict[str, Any] = {"username": user.username, "org": user.org, "id": user.id}
    if generated:
        shown["password"] = password
    print_object(args, shown)
    if generated and not args.json:
        print("(the password is shown only this once: store it now)", file=sys.stderr)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        users = await store_credentials.list_credentials(conn)
    print_rows(
        args, [vars(u) for u in users], ["username", "org", "disabled", "created_at", "disabled_at"]
    )
    return 0


async def cmd_disable(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        user = await store_credentials.disable_credential(conn, args.username)
    if user is None:
        raise CliError(f"there is no user '{args.username}'")
    print_object(
        args, {"username": user.username, "org": user.org, "disabled_at": user.disabled_at}
    )
    return 0
