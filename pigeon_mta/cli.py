"""The `pigeon-mta` command: argument parsing and error reporting only; the work is elsewhere."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from pigeon_mta import __version__
from pigeon_mta.app import use_uvloop
from pigeon_mta.commands import dkim, domains, log, orgs, queue, service, suppress, users
from pigeon_mta.commands.common import CliError, eprint
from pigeon_mta.config import ConfigError
from pigeon_mta.logs import setup_logging
from pigeon_mta.store.connect import DatabaseUnavailable

COMMAND_MODULES = [service, orgs, domains, users, dkim, queue, log, suppress]

EXIT_ERROR = 1
EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pigeon-mta", description="SMTP relay that queues in PostgreSQL."
    )
    parser.add_argument("--version", action="version", version=f"pigeon-mta {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(
        os.environ.get("PIGEON_LOG_LEVEL", "info" if args.command == "serve" else "warning")
    )
    try:
        use_uvloop()
        return int(asyncio.run(args.handler(args)) or 0)
    except ConfigError as exc:
        eprint(f"pigeon-mta: config error: {exc}")
        return EXIT_CONFIG
    except (CliError, DatabaseUnavailable) as exc:
        eprint(f"pigeon-mta: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`pigeon-mta log X --json | head`): not worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
