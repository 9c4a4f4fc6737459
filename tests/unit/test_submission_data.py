"""The DATA reader: end-of-data found however the bytes arrive, dots unstuffed, limits kept."""

from __future__ import annotations

import asyncio
import base64
import email
import email.policy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon_mta.intake.lines import fold_long_lines
from pigeon_mta.submission.data import Data, DataProblem, read_data


def stuff(lines: list[bytes]) -> bytes:
    return b"".join((b"." + line if line.startswith(b".") else line) + b"\r\n" for line in lines)


async def feed(
    wire: bytes,
    cuts: list[int],
    *,
    max_size: int | None = None,
    limit: int = 1001,
    fold: bool = True,
) -> tuple[Data, bytes]:
    """Run read_data on `wire` arriving in pieces cut at `cuts`; also return what is left."""
    reader = asyncio.StreamReader(limit=limit)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})

    async def arrive() -> None:
        for start, end in itertools.pairwise(points):
            reader.feed_data(wire[start:end])
            await asyncio.sleep(0)
        reader.feed_eof()

    feeder = asyncio.create_task(arrive())
    data = await read_data(reader, max_size=max_size, fold=fold)
    await feeder
    return data, await reader.read()


lines_strategy = st.lists(
    st.one_of(
        st.sampled_from([b"", b".", b"..", b".\r", b"a\n.", b"\n", b"x."]),
        st.binary(max_size=60).map(lambda b: b.replace(b"\r\n", b"")),
    ),
    max_size=25,
).map(lambda lines: [ln for ln in lines if b"\r\n" not in ln and not ln.endswith(b"\r")])


@settings(max_examples=300, deadline=None)
@given(lines=lines_strategy, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_any_body_in_any_pieces(lines: list[bytes], cuts: list[int]) -> None:
    wire = stuff(lines) + b".\r\nQUIT\r\n"
    data, left = asyncio.run(feed(wire, cuts))
    assert data.problem is None
    assert data.content == b"".join(line + b"\r\n" for line in lines)
    assert left == b"QUIT\r\n"  # the next command stays for the command reader


@pytest.mark.parametrize(
    ("wire", "content"),
    [
        (b".\r\n", b""),
        (b"a\r\n.\r\n", b"a\r\n"),
        (b"..\r\n.\r\n", b".\r\n"),
        (b"a\n.\nb\r\n.\r\n", b"a\n.\nb\r\n"),  # bare LF + dot is not the end
        (b"a\n.\r\nb\r\n.\r\n", b"a\n.\r\nb\r\n"),
        (b"end.\r\n.\r\n", b"end.\r\n"),
    ],
)
async def test_end_of_data(wire: bytes, content: bytes) -> None:
    data, left = await feed(wire, [])
    assert (data.content, left) == (content, b"")


async def test_too_big_is_read_to_the_end_and_dropped() -> None:
    wire = b"x" * 70 + b"\r\n"
    data, left = await feed(wire * 100 + b".\r\nNOOP\r\n", [5, 700, 3000], max_size=1000)
    assert data.problem is DataProblem.TOO_BIG and data.content == b""
    assert left == b"NOOP\r\n"
    exact = b"y" * 998 + b"\r\n"
    assert (await feed(exact + b".\r\n", [], max_size=1000))[0].problem is None


async def test_long_lines() -> None:
    ok = b"." + b"z" * 998 + b"\r\n.\r\n"  # a stuffed dot on a line of 998 octets
    data = (await feed(ok, [400]))[0]
    assert (data.content, data.folded) == (b"z" * 998 + b"\r\n", 0)
    huge = b"z" * (1024 * 1024) + b"\r\n.\r\nQUIT\r\n"
    data, left = await feed(huge, [1, 70000], fold=False)
    assert data.problem is DataProblem.LINE_TOO_LONG
    assert left == b"QUIT\r\n"
    data, left = await feed(huge, [1, 70000])
    assert data.problem is None and data.folded == 1 and left == b"QUIT\r\n"
    lines = data.content.split(b"\r\n")
    assert max(len(line) for line in lines) == 998
    assert b"".join(line.removeprefix(b" ") for line in lines) == b"z" * (1024 * 1024)


def test_folding_keeps_headers_and_base64_meaning() -> None:
    subject = b"Subject: " + b"word " * 400 + b"end"
    encoded = base64.b64encode(bytes(range(256)) * 20)  # one 6,828-octet line
    body = subject + b"\r\nX-Short: yes\r\n\r\n" + encoded + b"\r\n" + b"y" * 998 + b"\r\n"
    folded, count = fold_long_lines(body)
    assert count == 2
    lines = folded.split(b"\r\n")
    assert max(len(line) for line in lines) <= 998
    # The header is folded at its spaces: unfolding (RFC 5322 2.2.3) gives it back as it was.
    parsed = email.message_from_bytes(folded, policy=email.policy.compat32)
    assert parsed["Subject"].replace("\r\n", "") == subject.decode()[len("Subject: ") :]
    assert parsed["X-Short"] == "yes"
    # base64 ignores the spaces that start the continuation parts.
    assert base64.b64decode(parsed.get_payload().split("\r\n" + "y")[0]) == bytes(range(256)) * 20
    assert lines[-2] == b"y" * 998  # a line of exactly 998 octets is left alone
    assert fold_long_lines(b"short\r\n") == (b"short\r\n", 0)


async def test_hang_up_mid_data() -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        await feed(b"Subject: x\r\n\r\nbody", [3])


async def test_bare_lf_lines_are_measured_as_lines_and_folded_after_becoming_crlf() -> None:
    """Many applications end lines with a bare LF (intake/fixups.py makes them CRLF): such a
    message is not one long line. Short LF lines stay as they are; a long one is folded."""
    short = b"Subject: hi\nTo: b@example.net\n\n" + b"a line of text\n" * 80
    data = (await feed(short + b"\r\n.\r\n", [100]))[0]
    assert (data.content, data.folded) == (short + b"\r\n", 0)
    long_header = b"References: " + b" ".join(b"<id%d@example.com>" % n for n in range(80))
    wire = long_header + b"\nSubject: hi\n\n" + b"x" * 1500 + b"\nend\r\n.\r\n"
    data = (await feed(wire, [700]))[0]
    assert data.folded == 2
    parsed = email.message_from_bytes(data.content, policy=email.policy.compat32)
    assert parsed["Subject"] == "hi"  # the header section did not end early
    assert parsed["References"].replace("\r\n", "") == long_header.decode()[len("References: ") :]
    lines = data.content.split(b"\r\n")
    assert b"\n" not in data.content.replace(b"\r\n", b"")
    assert max(len(line) for line in lines) <= 998 and lines[-2] == b"end"


@pytest.mark.parametrize(
    ("line", "parts"),
    [
        (b"y" * 999, [b"y" * 998, b" y"]),  # one octet over: a hard cut
        (b"a" * 600 + b"\t" + b"b" * 600, [b"a" * 600, b"\t" + b"b" * 600]),  # a tab is a fold
        # The run of white space goes to the next part, whole.
        (b"a" * 900 + b"   " + b"b" * 200, [b"a" * 900, b"   " + b"b" * 200]),
        # Only white space before the limit: a hard cut, no part that is all white space.
        (b" " * 10 + b"c" * 1200, [b" " * 10 + b"c" * 988, b" " + b"c" * 212]),
        (b" " * 2000, [b" " * 998, b" " * 998, b" " * 6]),
    ],
    ids=["999 octets", "tab", "white-space run", "leading white space", "all white space"],
)
def test_fold_points(line: bytes, parts: list[bytes]) -> None:
    folded, count = fold_long_lines(b"Subject: x\r\n\r\n" + line + b"\r\n")
    assert folded.split(b"\r\n")[2:-1] == parts and count == 1


def test_a_25_mib_line_folds_into_998_octet_parts() -> None:
    folded, count = fold_long_lines(b"z" * (25 << 20))
    parts = folded.split(b"\r\n")
    assert count == 1 and len(parts) == -(-((25 << 20) - 998) // 997) + 1
    assert parts[0] == b"z" * 998 and all(p == b" " + b"z" * 997 for p in parts[1:-1])
