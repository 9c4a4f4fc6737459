"""`serve`, `migrate`, `check-config`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pigeon_mta import supervisor
from pigeon_mta.commands.common import (
    CliError,
    add_common,
    eprint,
    format_age,
    open_database,
    print_object,
    settings_from,
)
from pigeon_mta.config import ListenerSettings, Settings
from pigeon_mta.config_loader import load_settings
from pigeon_mta.redaction import redact


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run listeners, delivery engine and metrics until SIGTERM")
    add_common(p)
    p.add_argument(
        "--processes", type=int, metavar="N", help="worker processes (default: one per core)"
    )
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("migrate", help="apply database schema migrations")
    add_common(p)
    p.set_defaults(handler=cmd_migrate)

    p = sub.add_parser("check-config", help="validate a config file and say what is wrong")
    add_common(p)
    p.add_argument("file", nargs="?", metavar="FILE", help="the file to check (default: --config)")
    p.set_defaults(handler=cmd_check_config)


async def cmd_serve(args: argparse.Namespace) -> int:
    from pigeon_mta.node import ServeRefused

    settings = settings_from(args)
    try:
        return await supervisor.serve(settings, processes=args.processes)
    except ServeRefused as exc:
        raise CliError(str(exc)) from None


async def cmd_migrate(args: argparse.Namespace) -> int:
    from pigeon_mta.store import migrate as store_migrate

    async with open_database(args) as (_settings, conn):
        rows = await conn.fetch(
            "SELECT version, name, applied_at FROM schema_migration ORDER BY version"
        )
        pending = await store_migrate.pending_migrations(conn)
    print_object(
        args,
        {
            "schema_version": rows[-1]["version"] if rows else 0,
            "applied": len(rows),
            "pending": len(pending),
        },
    )
    return 0


async def cmd_check_config(args: argparse.Namespace) -> int:
    """Load the file (a mistake is a ConfigError, exit status 2), say what it sets up, and print
    the warnings that `serve` would log at start on stderr (they do not change the status)."""
    from pigeon_mta.config_review import config_warnings, routing_summary

    path = args.file or args.config or os.environ.get("PIGEON_CONFIG") or None
    settings = load_settings(path)
    warnings = config_warnings(settings)
    for warning in warnings:
        eprint(f"pigeon-mta: warning: {warning}")
    summary: dict[str, object] = {
        "config": settings.source,
        "status": "ok",
        "hostname": settings.server.hostname,
        "listeners": ", ".join(_listener_text(lsn) for lsn in settings.listener),
        "api": _api_text(settings),
        "database": _database_text(settings),
        "delivery": routing_summary(settings),
        "lanes": _lanes_text(settings),
    }
    if args.json:
        summary["warnings"] = warnings
    print_object(args, summary)
    return 0


def _listener_text(listener: ListenerSettings) -> str:
    lane = f" (lane {listener.lane})" if listener.lane else ""
    return f"{listener.name}={listener.address}/{listener.mode}{lane}"


def _api_text(settings: Settings) -> str:
    api = settings.api
    if api.listen is None:
        return "off"
    return f"{'https' if api.tls_cert else 'http'}://{api.listen}"


def _lanes_text(settings: Settings) -> str:
    """Each lane with its weight, and its rate and max_age when it sets them."""
    lanes = []
    for name, lane in sorted(settings.lanes.items()):
        parts = [f"weight {lane.weight:g}"]
        if lane.rate:
            parts.append(f"rate {lane.rate:g}/s")
        if lane.max_age:
            parts.append(f"max_age {format_age(lane.max_age)}")
        lanes.append(f"{name} ({', '.join(parts)})")
    return ", ".join(lanes)


def _database_text(settings: Settings) -> str:
    if settings.database.url:
        return redact(settings.database.url)
    return f"embedded PostgreSQL in {Path(settings.server.data_dir).expanduser() / 'postgres'}"
