"""Plain shared values that cross stage boundaries: envelopes, claimed work, replies, outcomes."""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from pigeon_mta.plain import is_enhanced_code, plain_text


class Status(enum.StrEnum):
    """A recipient's place in the queue (the `recipient.status` column)."""

    QUEUED = "queued"
    DELIVERING = "delivering"
    DELIVERED = "delivered"
    BOUNCED = "bounced"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    SUPPRESSED = "suppressed"


FINAL_STATUSES = frozenset(
    {Status.DELIVERED, Status.BOUNCED, Status.EXPIRED, Status.CANCELLED, Status.SUPPRESSED}
)


class Outcome(enum.StrEnum):
    """What one delivery attempt means for one recipient."""

    DELIVERED = "delivered"
    DEFERRED = "deferred"
    BOUNCED = "bounced"
    EXPIRED = "expired"
    SUPPRESSED = "suppressed"
    # Operator decisions (`pigeon-mta queue cancel` / `queue retry`), recorded in the attempt log
    # beside the attempts; never the result of a delivery.
    CANCELLED = "cancelled"
    RETRIED = "retried"


# The delivery-log event type for each outcome (interface contract: `type` field).
# A complaint report about a recipient (feedback/), in the log and the API's timeline.
COMPLAINT_EVENT = "Complaint"

EVENT_TYPE = {
    Outcome.DELIVERED: "Delivery",
    Outcome.DEFERRED: "TransientFailure",
    Outcome.BOUNCED: "Bounce",
    Outcome.EXPIRED: "Expiration",
    Outcome.SUPPRESSED: "Suppressed",
    Outcome.CANCELLED: "Cancelled",
    Outcome.RETRIED: "Retried",
}


# The listener name recorded on DSNs (dsn.py builds them), which no client submitted.
# The category of every expiry, whoever decides it: the engine, when a deferral's next try would
# come after max_age (outbound/outcome.py, outbound/shaping.py; the last reply's own category is
# kept in the rule), and the sweeper, for due mail past it (store/upkeep.py).
EXPIRED_CATEGORY = "expired"
# The category of a recipient that expired at its message's deadline (the send intent's
# `expires_at`), not attempted again after it.
DEADLINE_CATEGORY = "deadline"
DSN_LISTENER = "bounce"


def message_kind(listener: str) -> str:
    """What a queued message is, as the API and webhook events say: "dsn" for a delivery status
    notification pigeon-mta made (to an org's sender, for mail that failed), else "message"."""
    return "dsn" if listener == DSN_LISTENER else "message"


@dataclass(frozen=True)
class Envelope:
    """A message as accepted by the submission side, ready to be queued."""

    org_id: uuid.UUID
    sender: str  # "" is the null sender (bounces)
    recipients: tuple[str, ...]
    body: bytes
    listener: str
    header_message_id: str | None = None  # the Message-ID header value, without angle brackets
    client_ip: str | None = None
    client_helo: str | None = None
    credential_id: uuid.UUID | None = None
    auth_user: str | None = None
    # When the message was received; the queue's clock (now()) when None. The Reception event,
    # the message row and the Received header all show this one instant.
    received_at: datetime | None = None
    tls_version: str | None = None  # the TLS session it arrived over, None without TLS
    tls_cipher: str | None = None
    # Seconds within which a recipient queued already under this org and Message-ID is not queued
    # again (limits.duplicate_window); 0 for a Message-ID the client did not supply. Only
    # store.duplicates.enqueue_submitted, the submission path's commit, honours it.
    duplicate_window: float = 0.0
    # BLAKE2b-128 of the content as the client sent it (the message's body over SMTP, the
    # request's body through the API): a message under a Message-ID queued within the window is
    # a duplicate only with the same content (store/duplicates.py).
    content_key: bytes | None = None
    # The lane it is delivered in ([lanes] in the settings), chosen at reception
    # (intake/lanes.py); stored on the message and on each of its recipients.
    lane: str = "transactional"
    # Set by the group commit when this process's engine takes the message as it is committed
    # (store/group_commit.py): its recipients are queued already claimed by that engine.
    handoff: Handoff | None = None
    # The ids of its recipient rows, one per recipient in order: made by the submitter (the HTTP
    # API answers with them without reading them back) or by the group commit when it hands the
    # message off; else at the enqueue.
    recipient_ids: tuple[uuid.UUID, ...] = ()
    # The send intent (intake/intent.py): no attempt after `expires_at`, none before `send_at`;
    # mail of one `order_key` reaches each recipient in order; the application's `metadata`.
    expires_at: datetime | None = None
    send_at: datetime | None = None
    order_key: str | None = None
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Handoff:
    """A message queued straight into its process's engine: the recipient rows are written
    `delivering`, leased to `owner` for `lease` seconds with attempt 1, as a claim would leave
    them, so that the engine delivers them without claiming them from the queue. A process that
    dies before it records them leaves leases that run out like a claim's."""

    owner: str
    lease: float


def storable_text(text: str | None) -> str | None:
    """Text from a remote peer made safe to store and log: undecodable bytes (aiosmtplib keeps them
    as lone surrogates) become U+FFFD and NUL characters go; PostgreSQL rejects both."""
    if text is None:
        return None
    if "\x00" in text:
        text = text.replace("\x00", "")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:
            # Surrogates that stand for no byte (JSON's "\\ud800", not aiosmtplib's): each one
            # becomes U+FFFD below.
            pass
        text = _SURROGATES.sub("\ufffd", text)
    return text


_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Reply:
    """An SMTP reply, or a local failure dressed as one (code 0 when nothing was said)."""

    code: int
    enhanced_code: str | None
    text: str

    def storable(self) -> Reply:
        """This reply with its texts made safe to store (see storable_text)."""
        enhanced, text = storable_text(self.enhanced_code), storable_text(self.text)
        if enhanced == self.enhanced_code and text == self.text:
            return self
        return Reply(self.code, enhanced, text or "")

    def plain(self, note: str = "") -> Reply:
        """This reply with nothing in it but plain ASCII (plain.py): its text one bounded line,
        its enhanced code only when well-formed, its code only when one of SMTP's; `note` is
        added to the text in parentheses."""
        text = plain_text(self.text)
        if note:
            text = f"{text} ({plain_text(note, 200)})"
        enhanced = self.enhanced_code if is_enhanced_code(self.enhanced_code) else None
        return Reply(self.code if 0 <= self.code <= 999 else 0, enhanced, text)

    def __str__(self) -> str:
        parts = [str(self.code)] if self.code else []
        if self.enhanced_code:
            parts.append(self.enhanced_code)
        parts.append(self.text)
        return " ".join(parts)


@dataclass(frozen=True)
class ClaimedRecipient:
    id: uuid.UUID
    address: str
    attempts: int  # including the attempt this claim is for; doubles as a fencing token
    # When this recipient's time in the queue began (its created_at; `queue retry` of a bounce or
    # expiry starts it again): delivery.max_age counts from here, for the engine as for expiry.
    queued_at: datetime
    # The reason, when the org's suppression list held the address at the claim: not attempted.
    suppressed: str | None = None
    # The reply the previous attempt recorded (None before the first, or after a lease ran out).
    last_reply: Reply | None = None


@dataclass(frozen=True)
class ClaimedRow:
    """One claimed recipient as the claim returns it, with its message; `group_deliveries`
    (outbound/claims.py) makes Deliveries of them."""

    queue_id: uuid.UUID
    org_id: uuid.UUID
    sender: str
    header_message_id: str | None
    received_at: datetime
    domain: str
    body: bytes | None  # on one row of each message (each body is read once)
    recipient: ClaimedRecipient
    lane: str = "transactional"
    # Claimed from its site's queue (store/migrations/0024): the budget key whose token the claim
    # took, and the seconds until that token is there.
    site: str | None = None
    site_delay: float = 0.0
    expires_at: datetime | None = None  # the message's deadline (model.Envelope)


@dataclass(frozen=True)
class Delivery:
    """One unit of outbound work: a message's recipients at one destination (a domain, or the
    domains that share a static route), claimed together; `domain` is the one it is routed by."""

    queue_id: uuid.UUID
    org_id: uuid.UUID
    sender: str
    domain: str
    header_message_id: str | None
    received_at: datetime
    body: bytes
    recipients: tuple[ClaimedRecipient, ...]
    lane: str = "transactional"
    # Claimed from a site's queue: the budget whose tokens the claim took (one per recipient),
    # and the seconds to wait before sending, until they are there.
    site: str | None = None
    site_delay: float = 0.0
    # The envelope sender it leaves with when that is not `sender`: a VERP address at a
    # return-path domain (feedback/return_paths.py), for its one recipient.
    mail_from: str | None = None
    # The message's deadline: no attempt starts after it (outbound/outcome.py).
    expires_at: datetime | None = None


@dataclass(frozen=True)
class Signed:
    """What the sign stage hands on: the bytes to send, and what DKIM made of them."""

    body: bytes
    # "signed d=DOMAIN s=SELECTOR" (one d=/s= pair per signature) or "unsigned: REASON"; None when
    # no signer ran. Kept with each attempt so that `pigeon-mta log` says why mail left unsigned.
    dkim: str | None = None


@dataclass(frozen=True)
class AttemptResult:
    """What happened to one recipient in one attempt; the engine records a batch of these."""

    recipient_id: uuid.UUID
    queue_id: uuid.UUID
    org_id: uuid.UUID
    attempt: int
    outcome: Outcome
    reply: Reply
    started_at: datetime
    duration: float = 0.0
    next_attempt_at: datetime | None = None  # only for DEFERRED
    mx_host: str | None = None
    ip: str | None = None
    port: int | None = None
    tls_version: str | None = None
    tls_cipher: str | None = None
    category: str | None = None  # bounce classification category
    rule: str | None = None  # the classification rule that matched
    dkim: str | None = None  # Signed.dkim of the message this attempt sent
