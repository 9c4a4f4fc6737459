"""Reading the DATA phase (RFC 5321 4.1.1.4, 4.5.2): up to the end-of-data line, in large pieces.

aiosmtpd reads DATA a line at a time; reading up to each ".\\r\\n" instead costs a few calls per
message. Only CRLF "." CRLF ends the data: a bare LF before the dot does not (that is how SMTP
smuggling hides a second message).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from pigeon_mta.submission.fixups import normalize_line_endings

END_OF_DATA = b"\r\n.\r\n"
# The longest line of text a message may carry (RFC 5321 4.5.3.1.6, RFC 5322 2.1.1).
LINE_LIMIT = 998


class DataProblem(enum.Enum):
    TOO_BIG = "too_big"
    LINE_TOO_LONG = "line_too_long"


@dataclass(frozen=True)
class Data:
    content: bytes  # dot-unstuffed, every line ending in CRLF; b"" when the problem is set
    size: int  # octets received, as counted against the size limit
    problem: DataProblem | None = None
    folded: int = 0  # lines over LINE_LIMIT that were broken (see fold_long_lines)


async def read_data(
    reader: asyncio.StreamReader, *, max_size: int | None, fold: bool = True
) -> Data:
    """Read up to the end-of-data line. Past `max_size` the rest is read and dropped, so that
    the connection stays in step with the client (the reply comes after the data, RFC 5321
    4.2.5). A line over 998 octets is folded (`fold_long_lines`), or with `fold` false makes
    the problem LINE_TOO_LONG. Raises asyncio.IncompleteReadError when the client hangs up."""
    pieces: list[bytes] = []
    size = 0
    tail = b"\r\n"  # the data starts at the beginning of a line
    too_big = False
    while True:
        try:
            piece = await reader.readuntil(b".\r\n")
        except asyncio.LimitOverrunError as exc:
            # No ".\r\n" within the reader's limit: take what is safe to take and go on.
            piece = await reader.read(max(exc.consumed, 1))
            done = False
        else:
            done = (tail + piece[-5:]).endswith(END_OF_DATA)
        size += len(piece)
        if not too_big and max_size and size > max_size + 3:
            too_big = True  # (+3: the final ".\r\n" is not message data)
            pieces.clear()
        if not too_big:
            pieces.append(piece)
        tail = (tail + piece)[-2:]
        if done:
            break
    if too_big:
        return Data(b"", size, DataProblem.TOO_BIG)
    content = unstuff(b"".join(pieces)[:-3])  # keep the CRLF before the final dot
    # A bare LF or CR ends a line too (submission.fixups makes it CRLF; so does folding, first).
    if any(len(line) > LINE_LIMIT for line in content.splitlines()):
        if not fold:
            return Data(b"", size, DataProblem.LINE_TOO_LONG)
        content, folded = fold_long_lines(normalize_line_endings(content))
        return Data(content, size, folded=folded)
    return Data(content, size)


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


def unstuff(content: bytes) -> bytes:
    """Remove the dot that the client put before every line starting with a dot (4.5.2)."""
    if content.startswith(b"."):
        content = content[1:]
    return content.replace(b"\r\n.", b"\r\n")
