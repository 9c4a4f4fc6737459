"""Reading the DATA phase (RFC 5321 4.1.1.4, 4.5.2): up to the end-of-data line, in large pieces.

aiosmtpd reads DATA a line at a time; reading up to each ".\\r\\n" instead costs a few calls per
message. Only CRLF "." CRLF ends the data: a bare LF before the dot does not (that is how SMTP
smuggling hides a second message).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from pigeon_mta.intake.lines import LINE_LIMIT, fold_long_lines, normalize_line_endings

END_OF_DATA = b"\r\n.\r\n"


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
    # A bare LF or CR ends a line too (intake/fixups.py makes it CRLF; so does folding, first).
    if any(len(line) > LINE_LIMIT for line in content.splitlines()):
        if not fold:
            return Data(b"", size, DataProblem.LINE_TOO_LONG)
        content, folded = fold_long_lines(normalize_line_endings(content))
        return Data(content, size, folded=folded)
    return Data(content, size)


def unstuff(content: bytes) -> bytes:
    """Remove the dot that the client put before every line starting with a dot (4.5.2)."""
    if content.startswith(b"."):
        content = content[1:]
    return content.replace(b"\r\n.", b"\r\n")
