"""UUIDv7 identifiers (RFC 9562): time-ordered, so the primary-key indexes grow at one end."""

from __future__ import annotations

import os
import time
import uuid


def new_id() -> uuid.UUID:
    """A UUIDv7: 48 bits of Unix milliseconds, version 7, 74 random bits, RFC 4122 variant."""
    return _uuid7(time.time_ns() // 1_000_000, int.from_bytes(os.urandom(10), "big"))


def new_ids(count: int) -> list[uuid.UUID]:
    """`count` UUIDv7s of the same millisecond, from one read of the random source."""
    millis = time.time_ns() // 1_000_000
    pool = os.urandom(10 * count)
    return [
        _uuid7(millis, int.from_bytes(pool[i : i + 10], "big")) for i in range(0, 10 * count, 10)
    ]


def _uuid7(millis: int, rand: int) -> uuid.UUID:
    value = (millis & 0xFFFF_FFFF_FFFF) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & 0x3FFF_FFFF_FFFF_FFFF
    return uuid.UUID(int=value)


def id_floor(unix_time: float) -> uuid.UUID:
    """The smallest UUIDv7 made at `unix_time`: every id made earlier sorts below it."""
    millis = max(0, int(unix_time * 1000))
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62))


def id_time(value: uuid.UUID) -> float:
    """The Unix time (seconds) a UUIDv7 was made."""
    return (value.int >> 80) / 1000.0
