"""Line endings and line lengths of a submitted message: pure functions on bytes."""

from __future__ import annotations

import re

from pigeon_mta.message import CRLF

# The longest line SMTP carries, without its CRLF (RFC 5321 section 4.5.3.1.6).
LINE_LIMIT = 998

_LONE_EOL = re.compile(rb"\r\n|\r|\n")


def normalize_line_endings(data: bytes) -> bytes:
    """Every bare LF or CR becomes CRLF.

    A bare LF is where SMTP smuggling hides ("\\n.\\r\\n" read as end-of-data by a later hop), and
    many applications send bare LFs in good faith: normalizing serves both.
    """
    crlf = data.count(CRLF)
    if data.count(b"\n") == crlf and data.count(b"\r") == crlf:
        return data
    return _LONE_EOL.sub(CRLF, data)


def fold_long_lines(content: bytes) -> tuple[bytes, int]:
    """Break every line over 998 octets so that the message can be relayed (RFC 5321 4.5.3.1.6);
    returns the content and how many lines were broken. `content` has CRLF line endings only.

    A line is broken before the last run of spaces or tabs within the limit that follows some
    other character (in a header that is a fold, RFC 5322 2.2.3, and changes nothing), else at
    the limit with a space starting the next part, as Postfix's smtp_line_length_limit does
    (base64 ignores the space; in other text it shows). Linear in the line's length."""
    out: list[bytes] = []
    folded = 0
    for line in content.split(b"\r\n"):
        if len(line) <= LINE_LIMIT:
            out.append(line)
            continue
        folded += 1
        pos, pad = 0, 0  # the next part starts at line[pos], after `pad` added spaces
        while len(line) - pos + pad > LINE_LIMIT:
            end = pos + LINE_LIMIT - pad  # what fits: line[pos:end]
            cut = _fold_point(line, pos, end)
            if cut is None:
                out.append(b" " * pad + line[pos:end])
                pos, pad = end, 1
            else:
                out.append(b" " * pad + line[pos:cut])
                pos, pad = cut, 0
        out.append(b" " * pad + line[pos:])
    return b"\r\n".join(out), folded


def _fold_point(line: bytes, pos: int, end: int) -> int | None:
    """The start of the last run of spaces or tabs in line[pos + 1 : end + 1] that follows a
    character other than those (so that line[pos:cut] is not all white space), or None."""
    cut = max(line.rfind(b" ", pos + 1, end + 1), line.rfind(b"\t", pos + 1, end + 1))
    if cut < 0:
        return None
    cut = pos + len(line[pos:cut].rstrip(_WHITE_SPACE))  # to the start of its run
    return cut if cut > pos else None


_WHITE_SPACE = b" \t"
