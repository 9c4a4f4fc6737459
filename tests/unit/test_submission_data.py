"""The DATA reader: end-of-data found however the bytes arrive, dots unstuffed, limits kept."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon_mta.submission.data import Data, DataProblem, read_data


def stuff(lines: list[bytes]) -> bytes:
    return b"".join((b"." + line if line.startswith(b".") else line) + b"\r\n" for line in lines)


async def feed(
    wire: bytes, cuts: list[int], *, max_size: int | None = None, limit: int = 1001
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
    data = await read_data(reader, max_size=max_size)
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
    assert (await feed(ok, [400]))[0].content == b"z" * 998 + b"\r\n"
    data, left = await feed(b"z" * (1024 * 1024) + b"\r\n.\r\nQUIT\r\n", [1, 70000])
    assert data.problem is DataProblem.LINE_TOO_LONG
    assert left == b"QUIT\r\n"


async def test_hang_up_mid_data() -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        await feed(b"Subject: x\r\n\r\nbody", [3])
