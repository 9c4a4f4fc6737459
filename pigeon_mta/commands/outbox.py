"""`outbox install`, `outbox list`: the outboxes of [[outbox]] in the applications' databases."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
from typing import Any

import asyncpg

from pigeon_mta.commands.common import CliError, add_common, print_rows, settings_from
from pigeon_mta.config import OutboxSettings, Settings
from pigeon_mta.outbox.table import Table, ddl
from pigeon_mta.redaction import redact

# An application's database that does not answer in this long is shown as unreachable.
CONNECT_TIMEOUT = 10.0


def register(sub: Any) -> None:
    outbox = sub.add_parser("outbox", help="tables in applications' databases that are relayed")
    commands = outbox.add_subparsers(dest="outbox_command", required=True)
    p = commands.add_parser(
        "install", help="create the outbox's table and trigger in the application's database"
    )
    add_common(p)
    p.add_argument("name", help="the [[outbox]] name")
    p.add_argument(
        "--print",
        action="store_true",
        help="print the DDL instead, for the application's own migrations",
    )
    p.set_defaults(handler=cmd_install)
    p = commands.add_parser(
        "list", help="each outbox: rows waiting, the oldest's age, rows refused, the last relay"
    )
    add_common(p)
    p.set_defaults(handler=cmd_list)


def _outbox(settings: Settings, name: str) -> OutboxSettings:
    for outbox in settings.outbox:
        if outbox.name == name:
            return outbox
    known = ", ".join(o.name for o in settings.outbox) or "none"
    raise CliError(
        f"there is no [[outbox]] named '{name}' in {settings.source} (outboxes: {known})"
    )


async def _connect(outbox: OutboxSettings) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(outbox.database, timeout=CONNECT_TIMEOUT)
    except (
        OSError,
        TimeoutError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        ValueError,
    ) as exc:
        raise CliError(
            f"outbox '{outbox.name}': cannot reach the application's database: "
            f"{redact(str(exc).strip() or type(exc).__name__)}"
        ) from None


async def cmd_install(args: argparse.Namespace) -> int:
    outbox = _outbox(settings_from(args), args.name)
    statements = ddl(outbox.table)
    if args.print:
        print(statements, end="")
        return 0
    conn = await _connect(outbox)
    try:
        async with conn.transaction():
            await conn.execute(statements)
    except asyncpg.PostgresError as exc:
        raise CliError(f"outbox '{outbox.name}': the table was not created: {exc}") from None
    finally:
        await conn.close()
    print(f"outbox '{outbox.name}': {outbox.table} is ready; pigeon-mta serve relays it")
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    rows = await asyncio.gather(*(_row(o) for o in settings.outbox))
    columns = ["name", "org", "table", "waiting", "oldest_age", "refused", "last_relayed", "error"]
    print_rows(args, rows, columns)
    return 0


async def _row(outbox: OutboxSettings) -> dict[str, Any]:
    row: dict[str, Any] = {"name": outbox.name, "org": outbox.org, "table": outbox.table}
    try:
        conn = await _connect(outbox)
    except CliError as exc:
        return {**row, "error": str(exc).partition(": ")[2]}
    try:
        backlog = await Table(outbox.table).backlog(conn)
    except asyncpg.PostgresError as exc:
        return {**row, "error": str(exc)}
    finally:
        await conn.close()
    return {
        **row,
        "waiting": backlog.waiting,
        "oldest_age": _age(backlog.oldest_age),
        "refused": backlog.refused,
        "last_relayed": backlog.last_relayed,
        "error": None,
    }


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return str(dt.timedelta(seconds=round(max(0.0, seconds))))
