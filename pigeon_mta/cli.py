"""The `pigeon-mta` command: argument parsing and error reporting only; the work is elsewhere.

Only the chosen command's module is imported. The service's modules (the supervisor, uvloop,
prometheus_client) and the DKIM command's (dkimpy, dnspython, cryptography) cost more than
everything an admin command such as `queue` or `log` needs, and `--version` needs none of them
(bench/README.md, "CLI start-up").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from pigeon_mta import __version__

# Each command: the module under pigeon_mta.commands that registers and runs it, and its help
# line in `pigeon-mta --help` (the module's own parser says the same when it is chosen).
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("service", "run listeners, delivery engine and metrics until SIGTERM"),
    "migrate": ("service", "apply database schema migrations"),
    "check-config": ("service", "validate a config file and say what is wrong"),
    "org": ("orgs", "tenants"),
    "domain": ("domains", "sender domains an org may use"),
    "user": ("users", "SMTP AUTH users"),
    "apikey": ("apikeys", "API keys of the HTTP API"),
    "dkim": ("dkim", "DKIM signing keys"),
    "queue": ("queue", "queue summary and administration"),
    "log": ("log", "where is a message, and why: its reception, every attempt, its state now"),
    "suppress": ("suppress", "suppression list"),
    "webhook": ("webhooks", "HTTP endpoints told about an org's mail"),
    "feedback": ("feedback", "bounces and complaint reports that came back"),
    "outbox": ("outbox", "tables in applications' databases that are relayed"),
    "sendmail": ("sendmail", "queue a message from standard input, as sendmail(1) does"),
}

EXIT_ERROR = 1
EXIT_CONFIG = 2


class _OnlyChosen:
    """The subparsers action as a command module sees it: only `chosen` is really added; the
    module's other commands are left as the placeholders build_parser made for them."""

    def __init__(self, sub: Any, chosen: str) -> None:
        self._sub = sub
        self._chosen = chosen

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if name == self._chosen:
            parser: argparse.ArgumentParser = self._sub.add_parser(name, **kwargs)
            return parser
        return argparse.ArgumentParser(add_help=False)  # never used


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command word: the first argument that is not an option (the top level has only
    --help and --version, which take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pigeon-mta", description="SMTP relay that queues in PostgreSQL."
    )
    parser.add_argument("--version", action="version", version=f"pigeon-mta {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if name == chosen:
            module = importlib.import_module(f"pigeon_mta.commands.{module_name}")
            module.register(_OnlyChosen(sub, name))
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _not_utf8(argv: Sequence[str]) -> str | None:
    """The first argument that was not valid UTF-8 (Python keeps such bytes as surrogates)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bad = _not_utf8(argv)
    if bad is not None:
        print(f"pigeon-mta: the argument {bad!r} is not valid UTF-8", file=sys.stderr)
        return EXIT_ERROR
    if chosen_command(argv) == "sendmail" and "--help" not in argv[: argv.index("sendmail")]:
        # sendmail's own options (-oi, -t, -f ADDR), which argparse cannot read.
        from pigeon_mta.commands import sendmail

        return sendmail.main(argv[argv.index("sendmail") + 1 :])
    args = build_parser(chosen_command(argv)).parse_args(argv)

    from pigeon_mta.commands.common import CliError, eprint
    from pigeon_mta.config_loader import ConfigError
    from pigeon_mta.logs import setup_logging
    from pigeon_mta.store.connect import DatabaseUnavailable

    setup_logging(
        os.environ.get("PIGEON_LOG_LEVEL", "info" if args.command == "serve" else "warning")
    )
    try:
        if args.command == "serve":
            from pigeon_mta.supervisor import use_uvloop

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
