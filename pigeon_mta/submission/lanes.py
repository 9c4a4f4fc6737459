"""Which lane a submitted message is delivered in ([lanes] in the settings): the first that says.

1. the X-Pigeon-Lane field of the message (submission/fixups.py takes it out of the message);
2. the lane of the AUTH user (`pigeon-mta user set USER --lane NAME`);
3. the lane of the listener (`lane` of its [[listener]]);
4. the default lane, "transactional".

A name in the field is compared without case and surrounding space. The field asks for a lane by
name, so a name the server does not have is refused (550 5.7.0): a typo must not move mail into
another lane unnoticed. Several fields must agree; an empty one says nothing (an application
template whose lane variable is unset) and is removed like the others.

A user's lane is stored in the database and the lanes in the settings: when the settings no
longer have it, the message falls back to the listener's lane or the default, with a warning in
the log (once per user, lane and process). Refusing it would stop the user's mail over a setting
the sender cannot change; the operator sees the warning and sets the user's lane again.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from dataclasses import dataclass

from pigeon_mta.config import DEFAULT_LANE
from pigeon_mta.submission import replies

log = logging.getLogger("pigeon_mta.submission")

# Of a name from the client, at most this much is repeated in a reply.
_SHOWN = 64


@dataclass(frozen=True)
class LaneChoice:
    lane: str  # the lane to store, or "" with `refusal` set
    refusal: str | None = None  # the reply for a field that names no lane


def choose_lane(
    fields: Sequence[str],
    *,
    user: str | None,
    user_lane: str | None,
    listener_lane: str,
    lanes: Container[str],
) -> LaneChoice:
    """The lane of a message, from its X-Pigeon-Lane `fields` (the values, in order), its AUTH
    `user` and that user's lane, and its listener's lane ("" for none); see the module docstring."""
    named = list(dict.fromkeys(v.strip().lower() for v in fields if v.strip()))
    if len(named) > 1:
        shown = ", ".join(_printable(n) for n in named)
        return LaneChoice("", replies.LANES_DIFFER.format(lanes=_cut(shown)))
    if named:
        if named[0] not in lanes:
            return LaneChoice("", replies.UNKNOWN_LANE.format(lane=_cut(_printable(named[0]))))
        return LaneChoice(named[0])
    if user_lane:
        if user_lane in lanes:
            return LaneChoice(user_lane)
        _warn_stale_user_lane(user or "?", user_lane)
    return LaneChoice(listener_lane or DEFAULT_LANE)


_warned: set[tuple[str, str]] = set()


def _warn_stale_user_lane(user: str, lane: str) -> None:
    if (user, lane) in _warned:
        return
    _warned.add((user, lane))
    log.warning(
        "user %s has the lane '%s', which is not a lane of [lanes] any more: its mail goes to "
        "the listener's lane or '%s' (set it with: pigeon-mta user set %s --lane NAME)",
        user,
        lane,
        DEFAULT_LANE,
        user,
    )


def _printable(text: str) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
