"""The sendmail door's command line and message (commands/sendmail.py says what it takes):
the options, the message as read from standard input, `-t`'s recipients, the From: field added
for a message that has none, and the sysexits(3) codes. Pure."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from email.utils import formataddr, getaddresses

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
        if set(arg[1:]) <= set("tiv"):  # flags, alone or together (getopt's -ti)
            options.from_headers |= "t" in arg
            options.dot_ends &= "i" not in arg
            options.verbose |= "v" in arg
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
    elif letter == "b" and value != "m":
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
    return addresses, b"".join(kept) + split.rest  # the rest begins with the blank line


def with_from(data: bytes, sender: str, full_name: str | None) -> bytes:
    """The message with a From: field for a message that has none (sendmail adds one)."""
    split = split_header(data.replace(b"\r\n", b"\n").replace(b"\n", CRLF))
    if any(field_name(f) == b"from" for f in split.fields):
        return data
    name = " ".join((full_name or "").split())  # no line breaks into the header
    try:
        shown = formataddr((name, sender), charset="utf-8")
    except UnicodeError:  # an internationalized address (SMTPUTF8): written as it is
        shown = f"{name} <{sender}>" if name else sender
    return f"From: {shown}\r\n".encode() + data


def addresses_of(arguments: Sequence[str], domain: str) -> list[str]:
    """The addresses of recipient arguments, as sendmail reads them: several to an argument
    ("a@x, b@y"), with names ("Ann <a@x>"), and a bare local name (cron's `root`) qualified with
    `domain` (Postfix's myorigin)."""
    found: list[str] = []
    for argument in arguments:
        if "," in argument or "<" in argument:
            found.extend(address for _name, address in getaddresses([argument]) if address)
        elif argument.strip():
            found.append(argument.strip())
    bad = [a for a in found if any(c.isspace() for c in a)]
    if bad:
        raise BadAddress(bad[0])
    return [qualified(a, domain) for a in found]


class BadAddress(ValueError):
    """A recipient argument that is no address ("not an address")."""


def qualified(address: str, domain: str) -> str:
    return address if "@" in address or not address else f"{address}@{domain}"
