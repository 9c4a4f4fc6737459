"""What every command shares: settings, a database connection, tables and JSON output, errors."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.config_loader import load_settings
from pigeon_mta.logs import printable
from pigeon_mta.redaction import redact
from pigeon_mta.store import connect as store_connect
from pigeon_mta.store import migrate as store_migrate


class CliError(Exception):
    """A user-facing failure: printed as one sentence on stderr, exit status 1."""


def settings_from(args: argparse.Namespace) -> Settings:
    return load_settings(getattr(args, "config", None))


@contextlib.asynccontextmanager
async def open_database(
    args: argparse.Namespace,
) -> AsyncIterator[tuple[Settings, asyncpg.Connection]]:
    """Settings and a migrated database connection for an admin command."""
    settings = settings_from(args)
    location = store_connect.locate_database(settings)
    try:
        conn = await store_connect.connect(location.url, settings)
    except (
        OSError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        TimeoutError,
        ValueError,  # asyncpg's, for a URL it cannot parse (a port that is not a number)
    ) as exc:
        raise CliError(
            f"cannot reach the database ({location.description}): {redact(str(exc))}"
        ) from None
    try:
        await store_migrate.migrate(conn)
        yield settings, conn
    finally:
        await conn.close()


def checked_lane(settings: Settings, lane: str) -> str:
    """`lane` if it is one of the settings' lanes, else a CliError naming them."""
    if lane not in settings.lanes:
        known = ", ".join(sorted(settings.lanes))
        raise CliError(
            f"there is no lane '{lane}' in the settings (lanes: {known}); declare it under "
            f"[lanes.{lane}] in the config file"
        )
    return lane


def jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def text_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, bool):
        return "yes" if value else "no"
    # Cells show what clients and remote servers sent (HELO names, addresses, replies): their
    # control characters are shown as escapes, never sent to the terminal.
    return printable(str(value), newlines=True)


def print_rows(
    args: argparse.Namespace, rows: Sequence[dict[str, Any]], columns: Sequence[str]
) -> None:
    """A table for people, or JSON (a list of objects) with --json."""
    if getattr(args, "json", False):
        print(json.dumps([jsonable(dict(r)) for r in rows], indent=2))
        return
    if not rows:
        print("(none)")
        return
    cells = [[text_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def print_object(args: argparse.Namespace, obj: dict[str, Any]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(jsonable(obj), indent=2))
        return
    width = max(len(k) for k in obj) if obj else 0
    for key, value in obj.items():
        print(f"{key.ljust(width)}  {text_cell(value)}")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="config file (default: $PIGEON_CONFIG)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def eprint(text: str) -> None:
    print(text, file=sys.stderr)


def format_age(seconds: float) -> str:
    """A short human duration: "3d 4h", "12m 5s", "0s"."""
    seconds = max(0, seconds)
    seconds = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    if seconds or not parts:
        parts.append(f"{seconds}s")
    return " ".join(parts[:2])
