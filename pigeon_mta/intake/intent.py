"""What a send intent asks of pigeon-mta besides its message: a deadline, a schedule, an ordering
key and the application's metadata. Pure: read from the X-Pigeon-* fields of a message (SMTP, a
raw API request or outbox row) or from the fields of the API's JSON form (api/compose.py).

| header | JSON | what |
|---|---|---|
| X-Pigeon-Expires | `expires_at` | no attempt starts after it; undelivered recipients expire then |
| X-Pigeon-Send-At | `send_at` | not attempted before it |
| X-Pigeon-Order-Key | `order_key` | within the org, mail with the key reaches each recipient in order |
| X-Pigeon-Meta-NAME | `metadata` {NAME: value} | the application's; never delivered |

A time is RFC 3339 with its offset (`2026-12-04T10:00:00Z`) or seconds from now (`300`). The
fields are requests to pigeon-mta, taken out of the message before it is signed (fixups.py);
an X-Pigeon-* field of any other name is refused by name, as a bad value is (IntentError).
X-Pigeon-Lane is the lane's (intake/lanes.py) and X-Pigeon-Submitted a trace field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

PREFIX = "x-pigeon-"
EXPIRES = "x-pigeon-expires"
SEND_AT = "x-pigeon-send-at"
ORDER_KEY = "x-pigeon-order-key"
META = "x-pigeon-meta-"
# Fields of the prefix that are not the intent's: the lane's request, and the trace field.
OTHERS = frozenset({"x-pigeon-lane", "x-pigeon-submitted"})

MAX_METADATA = 10
MAX_META_VALUE = 500
MAX_ORDER_KEY = 200
# How far ahead a schedule or a deadline may be.
MAX_AHEAD = timedelta(days=365)
META_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
_SECONDS = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")


class IntentError(ValueError):
    """A field of the intent that cannot be taken: `name` as the client wrote it."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


@dataclass(frozen=True)
class Intent:
    expires_at: datetime | None = None
    send_at: datetime | None = None
    order_key: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self == NONE

    def over(self, other: Intent) -> Intent:
        """This intent, with what it leaves unset taken from `other` (metadata merged, this
        one's names winning)."""
        return Intent(
            self.expires_at or other.expires_at,
            self.send_at or other.send_at,
            self.order_key or other.order_key,
            {**other.metadata, **self.metadata},
        )


NONE = Intent()


def from_fields(fields: Iterable[tuple[str, str]], now: datetime) -> Intent:
    """The intent of a message's X-Pigeon-* fields ((name as written, value)); the lane's and
    the trace's are passed over. Raises IntentError."""
    expires_at = send_at = None
    order_key = None
    metadata: dict[str, str] = {}
    for written, raw in fields:
        name = written.lower()
        value = " ".join(raw.split())  # unfolded
        if name in OTHERS:
            continue
        if name == EXPIRES:
            expires_at = _once(expires_at, written, parse_time(value, written, now))
        elif name == SEND_AT:
            send_at = _once(send_at, written, parse_time(value, written, now))
        elif name == ORDER_KEY:
            order_key = _once(order_key, written, checked_order_key(value, written))
        elif name.startswith(META):
            meta = name.removeprefix(META)
            if meta in metadata:
                raise IntentError(written, "is given twice")
            metadata[meta] = value
        else:
            raise IntentError(written, "is not a field pigeon-mta knows")
    intent = Intent(expires_at, send_at, order_key, _checked_metadata(metadata))
    return checked(intent, now, names=("X-Pigeon-Expires", "X-Pigeon-Send-At"))


def from_json(request: Mapping[str, Any], now: datetime) -> Intent:
    """The intent of the API's JSON fields `expires_at`, `send_at`, `order_key` and `metadata`
    (each may be absent or null). Raises IntentError naming the field."""
    times: dict[str, datetime | None] = {}
    for name in ("expires_at", "send_at"):
        value = request.get(name)
        if value is None:
            times[name] = None
        elif isinstance(value, bool) or not isinstance(value, str | int | float):
            raise IntentError(name, "must be an RFC 3339 time or a number of seconds from now")
        else:
            times[name] = parse_time(str(value), name, now)
    order_key = request.get("order_key")
    if order_key is not None:
        if not isinstance(order_key, str):
            raise IntentError("order_key", "must be a string")
        order_key = checked_order_key(order_key, "order_key")
    metadata = request.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntentError("metadata", "must be an object of string values")
    intent = Intent(times["expires_at"], times["send_at"], order_key, _checked_metadata(metadata))
    return checked(intent, now)


def parse_time(value: str, name: str, now: datetime) -> datetime:
    """An RFC 3339 time with its offset, or a number of seconds from `now`."""
    text = value.strip()
    if _SECONDS.fullmatch(text):
        seconds = float(text)
        if not 0 <= seconds <= MAX_AHEAD.total_seconds():
            raise IntentError(
                name, f"must be 0 to {MAX_AHEAD.days} days ahead, in seconds from now"
            )
        return now + timedelta(seconds=seconds)
    if not _RFC3339.fullmatch(text):
        raise IntentError(
            name, "must be an RFC 3339 time with its offset (2026-12-04T10:00:00Z) or seconds"
        )
    try:
        # astimezone overflows for the first and last hours of years 1 and 9999.
        when = datetime.fromisoformat(text.replace("z", "Z").replace("t", "T")).astimezone(UTC)
    except (ValueError, OverflowError):
        raise IntentError(name, "is not a time") from None
    if when > now + MAX_AHEAD:
        raise IntentError(name, f"is more than {MAX_AHEAD.days} days ahead")
    return when


def checked_order_key(value: str, name: str) -> str:
    if not 0 < len(value) <= MAX_ORDER_KEY or not all(" " <= c <= "~" for c in value):
        raise IntentError(name, f"must be 1 to {MAX_ORDER_KEY} printable ASCII characters")
    return value


def checked(
    intent: Intent, now: datetime, *, names: tuple[str, str] = ("expires_at", "send_at")
) -> Intent:
    """The intent, unless its deadline is past or not after its schedule (`names`: what the
    client called the two)."""
    expires, send = names
    if intent.expires_at is not None and intent.expires_at <= now:
        raise IntentError(expires, "is past already: the message would never be sent")
    if intent.expires_at and intent.send_at and intent.send_at >= intent.expires_at:
        raise IntentError(send, f"is not before {expires}: the message would never be sent")
    return intent


def _checked_metadata(metadata: Mapping[str, str]) -> Mapping[str, str]:
    if len(metadata) > MAX_METADATA:
        raise IntentError("metadata", f"has more than {MAX_METADATA} names")
    for name, value in metadata.items():
        if not META_NAME.fullmatch(name):
            raise IntentError(
                f"metadata.{name}" if len(name) < 60 else "metadata",
                "must be named with 1 to 40 lower-case letters, digits, '-' and '_'",
            )
        if len(value) > MAX_META_VALUE or not all(c.isprintable() for c in value):
            raise IntentError(
                f"metadata.{name}", f"must be at most {MAX_META_VALUE} printable characters"
            )
    return dict(metadata)


def _once(earlier: Any, name: str, value: Any) -> Any:
    if earlier is not None:
        raise IntentError(name, "is given twice")
    return value
