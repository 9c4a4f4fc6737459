"""Why the intake did not queue a message, in words of its own: each door (the SMTP handler, the
HTTP API) says it in its protocol (submission/replies.py, api/problems.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pigeon_mta.header_bounds import FieldProblem
from pigeon_mta.store.errors import is_bad_input


class Reason(enum.Enum):
    SENDER_NOT_OWNED = "the envelope sender is not at one of the org's sender domains"
    FIELD_NOT_OWNED = "an originator field names a domain that is not the org's"
    NO_FROM = "the message names no From: address"
    FIELD_UNREADABLE = "an originator field cannot be read within limits.max_from_*"
    RATE_LIMITED = "the credential reached limits.credential_rate_limit"
    HEADER_TOO_LARGE = "the header section is over limits.max_header_size"
    TOO_MANY_HOPS = "the message has limits.max_hops Received fields already"
    UNKNOWN_LANE = "a lane was asked for that the server does not have"
    LANES_DIFFER = "the X-Pigeon-Lane fields name different lanes"
    BAD_INTENT = "an X-Pigeon-* field is unknown or its value cannot be taken"
    DATABASE_TROUBLE = "the database could not be asked"
    # The commit failed: the message is not queued, unless the commit happened with its answer
    # lost (a connection broken during it); `error` says which.
    COMMIT_FAILED = "the commit failed"


@dataclass(frozen=True)
class Refusal:
    reason: Reason
    field: str | None = None  # the originator field, lower case ("from", "sender", ...)
    domain: str | None = None  # the domain not owned
    problem: FieldProblem | None = None  # FIELD_UNREADABLE: what is wrong with `field`
    # UNKNOWN_LANE / LANES_DIFFER: the names asked, printable and cut to be shown.
    lanes: tuple[str, ...] = ()
    # UNKNOWN_LANE: asked by the submission itself (the API's `lane`), not by X-Pigeon-Lane.
    asked_by_request: bool = False
    recent: int = 0  # RATE_LIMITED: the messages counted within the window
    # BAD_INTENT: the field as the client wrote it, and what is wrong with it.
    intent_field: str = ""
    intent_problem: str = ""
    error: BaseException | None = None  # DATABASE_TROUBLE / COMMIT_FAILED

    @property
    def passes(self) -> bool:
        """Whether it passes by itself, so that the same submission may succeed later: a rate,
        or database trouble that is not about the message's own values."""
        if self.reason is Reason.RATE_LIMITED:
            return True
        return self.error is not None and not is_bad_input(self.error)
