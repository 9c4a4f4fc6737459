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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from email.utils import formataddr, getaddresses
from typing import Any

from pigeon_mta.message import CRLF, field_name, field_value, split_header

EX_OK = 0
EX_USAGE = 64
EX_DATAERR = 65
EX_NOUSER = 67
EX_SOFTWARE = 70
EX_TEMPFAIL = 75
EX_CONFIG = 78

LISTENER = "sendmail"
# Options that take a value and change nothing here.
_IGNORED_WITH_VALUE = frozenset("BNRVXLOh")
# Options that stand alone and change nothing here (or are the default: -bm, -U).
_IGNORED_FLAGS = frozenset("Unm")


class UsageError(Exception):
    pass


@dataclass
class Options:
    recipients: list[str] = field(default_factory=list)
    from_headers: bool = False  # -t
    dot_ends: bool = True  # without -i / -oi
    sender: str | None = None  # -f
    full_name: str | None = None  # -F
    config: str | None = None  # -C
    verbose: bool = False  # -v: say the queue id on stderr


def parse(argv: Sequence[str]) -> Options:
    """The options of a sendmail command line. Raises UsageError."""
    options = Options()
    args = iter(argv)
    for arg in args:
        if arg == "--":
            options.recipients.extend(args)
            break
        if not arg.startswith("-") or arg == "-":
            options.recipients.append(arg)
            continue
        letter, rest = arg[1], arg[2:]
        if letter in "tiv" and not rest:
            options.from_headers |= letter == "t"
            options.dot_ends &= letter != "i"
            options.verbose |= letter == "v"
        elif letter in _IGNORED_FLAGS and not rest:
            pass
        elif letter in _WITH_VALUE:
            _take(options, letter, rest or _value_of(letter, args))
        else:
            raise UsageError(f"unknown option {arg}")
    return options


# Options that take a value (in the same argument, -fADDR, or the next, -f ADDR).
_WITH_VALUE = frozenset("obfrFC") | _IGNORED_WITH_VALUE


def _value_of(letter: str, args: Iterator[str]) -> str:
    value = next(args, None)
    if value is None:
        raise UsageError(f"option -{letter} needs a value")
    return value


def _take(options: Options, letter: str, value: str) -> None:
    if letter == "o" and value == "i":
        options.dot_ends = False  # -oi; other -o options (-odi, -oem) are ignored
    elif letter == "b" and value not in ("m", "d"):
        raise UsageError(f"-b{value} is not supported: only -bm (send a message)")
    elif letter in "fr":
        options.sender = value.strip().removeprefix("<").removesuffix(">")
    elif letter == "F":
        options.full_name = value
    elif letter == "C":
        options.config = value


def read_message(data: bytes, *, dot_ends: bool) -> bytes:
    """The message on standard input, up to a line of one dot unless -i."""
    if not dot_ends:
        return data
    lines = data.splitlines(keepends=True)
    for n, line in enumerate(lines):
        if line.rstrip(b"\r\n") == b".":
            return b"".join(lines[:n])
    return data


def header_recipients(data: bytes) -> tuple[list[str], bytes]:
    """-t: the addresses of the To:, Cc: and Bcc: fields, and the message without Bcc:."""
    split = split_header(data.replace(b"\r\n", b"\n").replace(b"\n", CRLF))
    values = [field_value(f) for f in split.fields if field_name(f) in (b"to", b"cc", b"bcc")]
    addresses = [address for _name, address in getaddresses(values) if address]
    kept = [f for f in split.fields if field_name(f) != b"bcc"]
    separator = CRLF if split.separated else b""
    return addresses, b"".join(kept) + separator + split.rest


def with_from(data: bytes, sender: str, full_name: str | None) -> bytes:
    """The message with a From: field for a message that has none (sendmail adds one)."""
    split = split_header(data.replace(b"\r\n", b"\n").replace(b"\n", CRLF))
    if any(field_name(f) == b"from" for f in split.fields):
        return data
    shown = formataddr((full_name or "", sender))
    return f"From: {shown}\r\n".encode() + data


def main(argv: Sequence[str] | None = None) -> int:
    """The `sendmail` program (and `pigeon-mta sendmail ARGS`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--help"]:
        print(__doc__)
        return EX_OK
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
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"
