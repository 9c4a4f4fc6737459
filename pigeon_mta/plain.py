"""Text from outside read as US-ASCII: digits, status codes, and one bounded printable line.

Python's `\\d`, `str.isdigit()` and `int()` take every Unicode digit: `int("5\u0661")` is 51,
and `\\d` matches the ARABIC-INDIC DIGIT ONE in a hostile `550 5.\u0661.1`. SMTP's codes (RFC
5321 4.2), enhanced status codes (RFC 3463 2) and every number a peer or a client writes are
ASCII digits, so everything that reads one reads it here, and nothing in the package writes
`\\d` (tests/unit/test_plain.py holds it to that).
"""

from __future__ import annotations

import re

# An enhanced status code (RFC 3463 section 2): class, subject, detail.
ENHANCED_CODE = re.compile(r"([245])\.([0-9]{1,3})\.([0-9]{1,3})", re.ASCII)

# The longest text `plain_text` gives by default: one DSN field, one log field.
PLAIN_TEXT_LIMIT = 900

_CONTROLS = re.compile(r"[\x00-\x1f\x7f]+")


def is_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits (never other scripts' digits)."""
    return text.isascii() and text.isdigit()


def is_enhanced_code(text: str | None) -> bool:
    """Whether `text` is a well-formed enhanced status code such as 5.1.1."""
    return text is not None and ENHANCED_CODE.fullmatch(text) is not None


def plain_text(text: str, limit: int | None = PLAIN_TEXT_LIMIT) -> str:
    """`text` as one line of printable US-ASCII of at most `limit` characters (None: any):
    control characters become spaces, runs of white space one space, anything beyond ASCII a
    backslash escape (`\\u0661`), and what is left over the limit is cut, marked with "..."."""
    text = " ".join(_CONTROLS.sub(" ", text).split())
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    if limit is None or len(text) <= limit:
        return text
    return text[: max(0, limit - 3)] + "..."


def plain_error(exc: BaseException, limit: int = 200) -> str:
    """An exception as one plain line for a log or a recorded text: its type and its message."""
    return plain_text(f"{type(exc).__name__}: {exc}", limit)
