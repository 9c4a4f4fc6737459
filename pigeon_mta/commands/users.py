"""`user add|list|set|passwd|disable|enable|delete`: SMTP AUTH users.

The username rule (which characters, which names count as the same) is in store/credentials.py.
A user's lane is the lane of the mail it sends unless a message names one (intake/lanes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from pigeon_mta.commands.common import (
    CliError,
    add_common,
    checked_lane,
    open_database,
    print_object,
    print_rows,
)
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.store import orgs as store_orgs

MIN_PASSWORD = store_credentials.MIN_PASSWORD


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
    _add_password_stdin(p)
    p.add_argument(
        "--lane", metavar="NAME", help="the lane of its mail (default: the listener's lane)"
    )
    p.set_defaults(handler=cmd_add)
    p = user.add_parser("list", help="list users")
    add_common(p)
    p.set_defaults(handler=cmd_list)
    p = user.add_parser("set", help="change a user's settings: its lane")
    add_common(p)
    p.add_argument("username")
    lane = p.add_mutually_exclusive_group(required=True)
    lane.add_argument("--lane", metavar="NAME", help="the lane of its mail from its next AUTH")
    lane.add_argument(
        "--no-lane",
        action="store_true",
        help="no lane of its own: its mail goes to the listener's lane",
    )
    p.set_defaults(handler=cmd_set)
    p = user.add_parser(
        "passwd", help="set a user's password (generated and printed once unless --password-stdin)"
    )
    add_common(p)
    p.add_argument("username")
    _add_password_stdin(p)
    p.set_defaults(handler=cmd_passwd)
    for name, handler, text in (
        ("disable", cmd_disable, "refuse a user's AUTH from now on"),
        ("enable", cmd_enable, "accept a disabled user's AUTH again"),
        ("delete", cmd_delete, "delete a user (its queued mail is still delivered)"),
    ):
        p = user.add_parser(name, help=text)
        add_common(p)
        p.add_argument("username")
        p.set_defaults(handler=handler)


def _add_password_stdin(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--password-stdin",
        action="store_true",
        help=f"read the password (one line, at least {MIN_PASSWORD} characters) from standard "
        "input instead of generating one",
    )


def _check_username(username: str) -> None:
    problem = store_credentials.username_problem(username)
    if problem:
        raise CliError(problem)


def _read_password() -> str:
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CliError("the password on standard input is not valid UTF-8") from None
    password = text[:-1] if text.endswith("\n") else text
    password = password[:-1] if password.endswith("\r") else password
    if not password:
        raise CliError("no password on standard input")
    if "\n" in password or "\0" in password:
        raise CliError("the password on standard input must be one line")
    if len(password) < MIN_PASSWORD:
        raise CliError(
            f"the password on standard input has {len(password)} characters; "
            f"it needs at least {MIN_PASSWORD}"
        )
    return password


async def _new_password(args: argparse.Namespace) -> tuple[str, str]:
    """(password, its hash): read from stdin, or generated."""
    password = _read_password() if args.password_stdin else store_credentials.generate_password()
    return password, await asyncio.to_thread(store_credentials.hash_password, password)


def _show_password(args: argparse.Namespace, shown: dict[str, Any], password: str) -> None:
    if not args.password_stdin:
        shown["password"] = password
    print_object(args, shown)
    if not args.password_stdin and not args.json:
        print("(the password is shown only this once: store it now)", file=sys.stderr)


async def cmd_add(args: argparse.Namespace) -> int:
    _check_username(args.username)
    password, password_hash = await _new_password(args)
    async with open_database(args) as (settings, conn):
        lane = checked_lane(settings, args.lane) if args.lane is not None else None
        org = await store_orgs.find_org(conn, args.org)
        if org is None:
            raise CliError(
                f"there is no org '{args.org}' (create it with: pigeon-mta org add NAME)"
            )
        try:
            user = await store_credentials.add_credential(
                conn, org.id, args.username, password_hash, lane=lane
            )
        except store_credentials.CredentialExists as exc:
            raise CliError(str(exc)) from None
    shown = {"username": user.username, "org": user.org, "id": user.id, "lane": user.lane}
    _show_password(args, shown, password)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        users = await store_credentials.list_credentials(conn)
    print_rows(
        args,
        [vars(u) for u in users],
        ["username", "org", "disabled", "created_at", "disabled_at", "lane"],
    )
    return 0


async def cmd_set(args: argparse.Namespace) -> int:
    async with open_database(args) as (settings, conn):
        lane = None if args.no_lane else checked_lane(settings, args.lane)
        user = await store_credentials.set_lane(conn, args.username, lane)
    if user is None:
        raise CliError(f"there is no user '{args.username}'")
    print_object(args, {"username": user.username, "org": user.org, "lane": user.lane})
    return 0


async def cmd_passwd(args: argparse.Namespace) -> int:
    password, password_hash = await _new_password(args)
    async with open_database(args) as (_settings, conn):
        user = await store_credentials.set_password(conn, args.username, password_hash)
    if user is None:
        raise CliError(f"there is no user '{args.username}'")
    _show_password(args, {"username": user.username, "org": user.org}, password)
    return 0


async def cmd_disable(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        user = await store_credentials.disable_credential(conn, args.username)
    return _print_state(args, user)


async def cmd_enable(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        user = await store_credentials.enable_credential(conn, args.username)
    return _print_state(args, user)


def _print_state(args: argparse.Namespace, user: store_credentials.Credential | None) -> int:
    if user is None:
        raise CliError(f"there is no user '{args.username}'")
    print_object(
        args,
        {
            "username": user.username,
            "org": user.org,
            "disabled": user.disabled,
            "disabled_at": user.disabled_at,
        },
    )
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    async with open_database(args) as (_settings, conn):
        user = await store_credentials.delete_credential(conn, args.username)
    if user is None:
        raise CliError(f"there is no user '{args.username}'")
    print_object(args, {"username": user.username, "org": user.org, "deleted": True})
    return 0
