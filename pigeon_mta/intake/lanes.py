"""Which lane a submitted message is delivered in ([lanes] in the settings).

The operator's lane comes first of these: the lane of the AUTH user (`pigeon-mta user set USER
--lane NAME`, or an API key's `--lane`), else the lane of the listener (`lane` of its
[[listener]]), else the default lane, "transactional". The message's X-Pigeon-Lane field
(intake/fixups.py takes it out of the message; the API's `lane`) may move it to another lane
as `[lanes] header` allows: "lower" (the default) only to a lane that weighs no more than the
operator's and sends no faster (a lane rate), so that a sender cannot put its campaign in the lane
of password resets, nor out of the rate the operator gave it; "any" to any
lane; "off" not at all (the field is removed and not read). A field the policy does not follow
leaves the operator's lane, with a line in the log.

A name in the field is compared without case and surrounding space. The field asks for a lane by
name, so a name the server does not have is refused: a typo must not move mail into
another lane unnoticed. Several fields must agree; an empty one says nothing (an application
template whose lane variable is unset) and is removed like the others.

A user's lane is stored in the database and the lanes in the settings: when the settings no
longer have it, the message falls back to the listener's lane or the default, with a warning in
the log (once per user, lane and process). Refusing it would stop the user's mail over a setting
the sender cannot change; the operator sees the warning and sets the user's lane again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pigeon_mta.config import API_KEY_USER_PREFIX, DEFAULT_LANE, LaneHeader, LaneSettings
from pigeon_mta.intake.refusal import Reason, Refusal

log = logging.getLogger("pigeon_mta.submission")

# Of a name from the client, at most this much is repeated in a reply.
_SHOWN = 64


@dataclass(frozen=True)
class LaneChoice:
    lane: str  # the lane to store, or "" with `refusal` set
    refusal: Refusal | None = None  # a field (or the request's lane) that names no lane
    # Why a field's lane was not followed (`[lanes] header`), for the log; None when it was.
    overruled: str | None = None


def choose_lane(
    fields: Sequence[str],
    *,
    user: str | None,
    user_lane: str | None,
    listener_lane: str,
    lanes: Mapping[str, LaneSettings],
    header: LaneHeader = "lower",
    asked: str | None = None,
) -> LaneChoice:
    """The lane of a message, from its X-Pigeon-Lane `fields` (the values, in order), its AUTH
    `user` and that user's lane, its listener's lane ("" for none) and the `header` policy; see
    the module docstring. `asked`: the lane the submission names itself (the HTTP API's `lane`),
    which stands for the fields and must name a lane."""
    operators = _operators_lane(user, user_lane, listener_lane, lanes)
    if header == "off":
        return LaneChoice(operators)
    if asked is not None:
        if asked.strip().lower() not in lanes:
            return LaneChoice(
                "", Refusal(Reason.UNKNOWN_LANE, lanes=(shown(asked),), asked_by_request=True)
            )
        fields = (asked,)
    named = list(dict.fromkeys(v.strip().lower() for v in fields if v.strip()))
    if len(named) > 1:
        return LaneChoice("", Refusal(Reason.LANES_DIFFER, lanes=tuple(map(shown, named))))
    if not named:
        return LaneChoice(operators)
    wanted = named[0]
    if wanted not in lanes:
        return LaneChoice("", Refusal(Reason.UNKNOWN_LANE, lanes=(shown(wanted),)))
    if header == "lower" and wanted != operators and not _no_more(lanes, wanted, operators):
        return LaneChoice(
            operators,
            overruled=f"X-Pigeon-Lane '{wanted}' weighs more, or sends faster, than the lane "
            f"'{operators}' the operator set (lanes.header = lower)",
        )
    return LaneChoice(wanted)


def _operators_lane(
    user: str | None, user_lane: str | None, listener_lane: str, lanes: Mapping[str, LaneSettings]
) -> str:
    if user_lane:
        if user_lane in lanes:
            return user_lane
        _warn_stale_user_lane(user or "?", user_lane)
    return listener_lane or DEFAULT_LANE


def _no_more(lanes: Mapping[str, LaneSettings], asked: str, operators: str) -> bool:
    """Whether lane `asked` gives no more than lane `operators`: no more weight, and no more
    rate (a rate of 0 is none: unlimited), so that a sender the operator slowed cannot name a
    lane of the same weight without the limit."""
    mine = lanes.get(operators, LaneSettings())
    other = lanes[asked]
    if other.weight > mine.weight:
        return False
    return mine.rate == 0 or 0 < other.rate <= mine.rate


_warned: set[tuple[str, str]] = set()


def _warn_stale_user_lane(user: str, lane: str) -> None:
    if (user, lane) in _warned:
        return
    _warned.add((user, lane))
    hint = (
        "an API key's lane is set when it is made: make a new key"
        if user.startswith(API_KEY_USER_PREFIX)
        else f"set it with: pigeon-mta user set {user} --lane NAME"
    )
    log.warning(
        "%s has the lane '%s', which is not a lane of [lanes] any more: its mail goes to "
        "the listener's lane or '%s' (%s)",
        user if user.startswith(API_KEY_USER_PREFIX) else f"user {user}",
        lane,
        DEFAULT_LANE,
        hint,
    )


def shown(name: str) -> str:
    """Text from the client as a reply may repeat it: printable ASCII, at most _SHOWN long."""
    text = "".join(c if " " <= c <= "~" else "?" for c in name)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
