"""The authserv-id of an Authentication-Results field value (RFC 8601 2.2), read up to the id.

An MSA removes the incoming Authentication-Results fields that bear its own authserv-id (RFC 8601
5), so the id must be read as a verifier would read it: after optional CFWS, whose comments may
nest (RFC 5322 3.2.2), as a token or a quoted-string (the `value` of RFC 2045 5.1), and compared
without regard to case. authres parses whole fields: it raises on a field whose results it does
not know (which then claims nobody's id, though a laxer reader may take it as ours), and it
recurses into nested comments (20,000 of them raise RecursionError). This reads only up to the id,
in one pass, with a depth count for comments.
"""

from __future__ import annotations

import re

# RFC 2045 5.1 tspecials, white space and controls end a token; anything else (UTF-8 included,
# RFC 8601 2.2 with RFC 6532) belongs to it.
_TOKEN = re.compile(r'[^\x00-\x20\x7f()<>@,;:\\"/\[\]?=]+')
_WHITE_SPACE = re.compile(r"[ \t\r\n]*")
# Within a comment only nesting matters, and a quoted-pair (one token here) hides a parenthesis;
# within a quoted-string, the closing quote.
_COMMENT_SPECIAL = re.compile(r"\\.|[()]", re.DOTALL)
_QUOTED_SPECIAL = re.compile(r'\\.|"', re.DOTALL)
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)


def authserv_id(value: str) -> str | None:
    """The authserv-id that `value` starts with, without quoting; None when there is none (an
    unclosed comment or quoted-string, or nothing a token can start with)."""
    pos = _skip_cfws(value, 0)
    if pos is None or pos >= len(value):
        return None
    if value[pos] == '"':
        return _quoted_string(value, pos + 1)
    token = _TOKEN.match(value, pos)
    return token.group() if token else None


def claims_authserv_id(value: str, hostname: str) -> bool:
    """Whether an Authentication-Results value bears `hostname` as its authserv-id."""
    found = authserv_id(value)
    return found is not None and found.lower() == hostname.lower()


def _skip_cfws(value: str, pos: int) -> int | None:
    """The position after white space and comments from `pos`; None if a comment is not closed."""
    while True:
        pos = _WHITE_SPACE.match(value, pos).end()  # type: ignore[union-attr]
        if not value.startswith("(", pos):
            return pos
        depth = 0
        for special in _COMMENT_SPECIAL.finditer(value, pos):
            char = special.group()
            if char == "(":
                depth += 1
            elif char == ")":
                depth -= 1
                if not depth:
                    pos = special.end()
                    break
        else:
            return None


def _quoted_string(value: str, pos: int) -> str | None:
    """The text of a quoted-string whose opening quote is just before `pos`, quoted-pairs undone."""
    for special in _QUOTED_SPECIAL.finditer(value, pos):
        if special.group() == '"':
            return _QUOTED_PAIR.sub(r"\1", value[pos : special.start()])
    return None
