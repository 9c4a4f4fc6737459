"""What a door hands the intake: who submits (`Submitter`), where it came in (`Door`), and the
message with its envelope (`Submission`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from pigeon_mta.intake.intent import NONE, Intent


@dataclass(frozen=True)
class Submitter:
    """Who submits: an SMTP AUTH user, an API key, or a client of a trusted network (no
    credential; its mail is `relay.trusted_org`'s)."""

    org_id: uuid.UUID | None  # None: relay.trusted_org, looked up by the intake
    org: str = ""  # the org's name, for refusals
    # The message's auth_user: the SMTP login, or apikey:<id>; None for a trusted client.
    auth_user: str | None = None
    credential_id: uuid.UUID | None = None  # an SMTP user's
    api_key: bool = False  # an API key (its rate is counted by auth_user)
    lane: str | None = None  # the credential's lane, if it has one

    @property
    def authenticated(self) -> bool:
        return self.auth_user is not None


@dataclass(frozen=True)
class Door:
    """Where a message came in: recorded in its trace field, its row and its Reception record."""

    listener: str  # the [[listener]]'s name, or config.API_LISTENER
    lane: str = ""  # the listener's lane, "" for none
    client_ip: str | None = None
    helo: str | None = None
    esmtp: bool = True
    smtputf8: bool = False
    tls_version: str | None = None
    tls_cipher: str | None = None
    # The trace field on top: SMTP's Received (and Authentication-Results), or the
    # X-Pigeon-Submitted of the HTTP API and the outboxes, which says how it came (`via`).
    trace: Literal["smtp", "http"] = "smtp"
    via: str = "HTTP"
    # MAIL's AUTH= (RFC 4954 section 5), as the client claimed it: recorded only.
    auth_param: str | None = None


@dataclass(frozen=True)
class Submission:
    door: Door
    submitter: Submitter
    sender: str  # "" is the null sender
    recipients: tuple[str, ...]  # each once, in the order given
    data: bytes  # the message as the client sent it
    lane: str | None = None  # the lane the submission names itself (the API's `lane`)
    # The send intent the submission states itself (the API's JSON fields); the message's
    # X-Pigeon-* fields fill in what it leaves unset.
    intent: Intent = NONE
    # BLAKE2b-128 of what the client sent, for the duplicate rule; None: the digest of the
    # message's body (fixups.Fixed.content_digest).
    content_key: bytes | None = None
    # The queue id the message takes, when the door must know it first (an Idempotency-Key
    # claims it); else the intake makes one.
    queue_id: uuid.UUID | None = None
    # A repeat of this submission (the same Idempotency-Key) may have queued `queue_id` first:
    # the intake then answers as that one queued it, instead of failing.
    repeatable: bool = False
    # The door refused already what the envelope sender check would refuse (SMTP does at MAIL,
    # with `Intake.check_sender`): the intake does not ask again.
    sender_checked: bool = False
    # Recipient ids made before the commit (the HTTP API answers with them).
    recipient_ids: bool = False
    # What this connection or request learned of its org's sender domains, by domain.
    owned: dict[str, bool] = field(default_factory=dict, compare=False)
