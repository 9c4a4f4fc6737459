"""`pigeon-mta sendmail` and the `sendmail` program: a message on standard input queued through the
one intake, for cron, PHP's mail() and scripts on the same host.

It takes the options those callers use, as Postfix's and Sendmail's sendmail do: recipients as
arguments, `-t` (also those of the To:, Cc: and Bcc: fields; Bcc: is taken out), `-i` / `-oi`
(a line of one dot does not end the message), `-f SENDER`, `-F "FULL NAME"` (for a From: field
the message lacks), `-C CONFIG` (the config file); the mode and queue options callers pass out
of habit (`-bm`, `-odi`, `-oem`, `-B`, `-N`, `-R`, `-V`, `-X`, `-L`, `-O`) are accepted and
ignored; `-v` prints the queue id. The mail is `relay.trusted_org`'s, as a trusted client's of the relay listener is;
its X-Pigeon-Submitted field names the local user. It is queued in the database before the
command exits 0; the exit status is otherwise one of sysexits(3), which callers understand:
64 a usage error, 65 a message that cannot be sent as it is, 67 a bad address, 75 the database
cannot be reached now (try again), 78 a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
from collections.abc import Sequence
from typing import Any

from pigeon_mta.commands.sendmail_message import (
    EX_OK,
    EX_SOFTWARE,
    EX_TEMPFAIL,
    EX_USAGE,
    Options,
    UsageError,
    parse,
)


def main(argv: Sequence[str] | None = None) -> int:
    """The `sendmail` program (and `pigeon-mta sendmail ARGS`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--help"]:
        print(__doc__)
        return EX_OK
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            print("sendmail: an argument is not valid UTF-8", file=sys.stderr)
            return EX_USAGE
    try:
        options = parse(args)
    except UsageError as exc:
        print(f"sendmail: {exc}", file=sys.stderr)
        return EX_USAGE
    data = sys.stdin.buffer.read()
    try:
        return asyncio.run(send(options, data))
    except KeyboardInterrupt:
        return EX_TEMPFAIL
    except Exception as exc:  # a defect: a code cron and PHP report, not a traceback
        print(f"sendmail: failed, nothing may be queued: {exc!r}", file=sys.stderr)
        return EX_SOFTWARE


def register(sub: Any) -> None:
    """For `pigeon-mta --help`: the options are sendmail's, read by `parse` (cli.py hands them
    over unparsed)."""
    p = sub.add_parser(
        "sendmail",
        help="queue a message from standard input, as sendmail(1) does (-t, -i, -f, -F)",
        add_help=False,
    )
    p.add_argument("arguments", nargs=argparse.REMAINDER)


async def send(options: Options, data: bytes) -> int:
    from pigeon_mta.commands.sendmail_intake import queue_message

    return await queue_message(options, data, user=_local_user())


def _local_user() -> str:
    """The caller's user name (from LOGNAME or USER, else the password database) as a trace
    field may carry it: printable ASCII, at most 64 characters."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = ""
    shown = "".join(c if "!" <= c <= "~" else "?" for c in name)[:64]
    return shown or f"uid{os.getuid()}"
