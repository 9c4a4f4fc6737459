"""The intake: how a message from any door (an SMTP listener, the HTTP API) becomes queued.

`Intake.accept(submission)` returns `Queued` or a `Refusal` (refusal.py). In order:
1. the org (a trusted client's is `relay.trusted_org`'s);
2. the envelope sender and the credential's rate (policy.py), unless the door checked them
   already (SMTP does at MAIL, with `check_sender`);
3. the fixups (fixups.py): a Received field, or for HTTP an X-Pigeon-Submitted field, a
   Message-ID or Date where missing, forged Authentication-Results and X-Pigeon-Lane taken out;
4. the originator fields against the sender policy;
5. the send intent of its X-Pigeon-* fields and the door's (intent.py), and the lane (lanes.py);
6. the commit, shared with other messages of the process by the group commit
   (store/group_commit.py, which hands the message to this process's engine or wakes the
   engines), shielded: a client that goes away does not cancel it half-way, and a message
   committed anyway is announced all the same;
7. the announcement (reception.py): Reception and Duplicate records, the "queued" log line.

Steps 1-5 are `prepare`, 6-7 `commit`: a door that must claim the queue id in between (the
API's Idempotency-Key) calls them apart. Only a Message-ID the client supplied says "the same
message again" (limits.duplicate_window, store/duplicates.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime

import asyncpg

from pigeon_mta import model
from pigeon_mta.config import Settings
from pigeon_mta.delivery_log import DeliveryLog
from pigeon_mta.ids import new_id, new_ids
from pigeon_mta.intake.fixups import Fixed, TooManyHops, Trace, apply_fixups
from pigeon_mta.intake.intent import IntentError, checked, from_fields
from pigeon_mta.intake.lanes import choose_lane
from pigeon_mta.intake.policy import SenderPolicy
from pigeon_mta.intake.reception import Reception, announce
from pigeon_mta.intake.refusal import Reason, Refusal
from pigeon_mta.intake.submission import Submission, Submitter
from pigeon_mta.message import HeaderTooLarge
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.duplicates import Duplicates
from pigeon_mta.store.errors import is_bad_input
from pigeon_mta.store.group_commit import Engine, GroupCommit

log = logging.getLogger("pigeon_mta.intake")


@dataclass(frozen=True)
class Queued:
    queue_id: uuid.UUID  # to answer with: the message's, or the first one's if all were duplicates
    envelope: model.Envelope
    # Queued as submitted: no recipient a duplicate, not queued first by a repeat. Its rows are
    # then the envelope's, and an answer needs no read-back.
    as_sent: bool


@dataclass(frozen=True)
class Prepared:
    """A message ready for its commit."""

    reception: Reception
    repeatable: bool = False

    @property
    def queue_id(self) -> uuid.UUID:
        return self.reception.queue_id

    def with_queue_id(self, queue_id: uuid.UUID) -> Prepared:
        return dataclasses.replace(
            self, reception=dataclasses.replace(self.reception, queue_id=queue_id)
        )


class TrustedOrg:
    """The id of `relay.trusted_org`, looked up (and created if missing) on first use."""

    def __init__(self, pool: asyncpg.Pool, name: str) -> None:
        self.pool = pool
        self.name = name
        self._id: uuid.UUID | None = None

    async def __call__(self) -> uuid.UUID:
        if self._id is None:
            self._id = await store_orgs.ensure_org(self.pool, self.name)
        return self._id


class Intake:
    """One per process, made by the composition root (app.py) and shared by every door."""

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        group_commit: GroupCommit,
        *,
        delivery_log: DeliveryLog | None = None,
        policy: SenderPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.group_commit = group_commit
        self.delivery_log = delivery_log
        self.policy = policy or SenderPolicy(settings, pool)
        self.trusted_org = TrustedOrg(pool, settings.relay.trusted_org)

    @classmethod
    def of(
        cls,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        commit_pool: asyncpg.Pool | None = None,
        engine: Engine | None = None,
        on_queued: Callable[[int], None] | None = None,
        delivery_log: DeliveryLog | None = None,
    ) -> Intake:
        """An intake with its own group commit on `commit_pool` (`pool` when not given), handing
        mail to `engine`; see store/group_commit.py."""
        group_commit = GroupCommit(commit_pool or pool, engine=engine, on_queued=on_queued)
        return cls(settings, pool, group_commit, delivery_log=delivery_log)

    async def org_of(self, submitter: Submitter) -> Submitter | Refusal:
        """The submitter with its org: a trusted client's is relay.trusted_org's."""
        if submitter.org_id is not None:
            return submitter
        try:
            org_id = await self.trusted_org()
        except DB_ERRORS as exc:
            return _database_trouble(exc, "cannot look up the trusted org")
        return dataclasses.replace(submitter, org_id=org_id, org=self.trusted_org.name)

    async def check_sender(
        self, submitter: Submitter, sender_domain: str | None, owned: dict[str, bool]
    ) -> Refusal | None:
        """The envelope sender (its domain; None for the null sender) and the rate."""
        try:
            refusal = await self.policy.check_sender(submitter, sender_domain, owned)
            return refusal or await self.policy.check_rate(submitter)
        except DB_ERRORS as exc:
            return _database_trouble(exc, f"cannot check the sender of {_who(submitter)}")

    async def accept(self, submission: Submission) -> Queued | Refusal:
        prepared = await self.prepare(submission)
        if isinstance(prepared, Refusal):
            return prepared
        return await self.commit(prepared)

    async def prepare(self, submission: Submission) -> Prepared | Refusal:
        """Steps 1-5 of the module docstring: the message as it is to be committed."""
        submitter = await self.org_of(submission.submitter)
        if isinstance(submitter, Refusal):
            return submitter
        assert submitter.org_id is not None
        door = submission.door
        client = f"[{door.client_ip or 'unknown'}]"
        if not submission.sender_checked:
            domain = submission.sender.rpartition("@")[2] if submission.sender else None
            refusal = await self.check_sender(submitter, domain, submission.owned)
            if refusal is not None:
                return refusal
        queue_id = submission.queue_id or new_id()
        received_at = datetime.now(UTC)
        new_message_id = f"{new_id().hex}@{self.settings.server.hostname}"
        fixed = self._fixups(submission, submitter, queue_id, received_at, new_message_id)
        if isinstance(fixed, Refusal):
            return fixed
        try:
            refusal = await self.policy.check_originators(
                submitter, fixed.address_fields, submission.owned, client=client
            )
        except DB_ERRORS as exc:
            return _database_trouble(exc, f"cannot check the originators from {client}")
        if refusal is not None:
            return refusal
        try:
            intent = checked(
                submission.intent.over(from_fields(fixed.intent_fields, received_at)),
                received_at,
            )
        except IntentError as exc:
            log.info("message from %s refused: %s", client, exc)
            return Refusal(Reason.BAD_INTENT, intent_field=exc.name, intent_problem=exc.problem)
        lanes = self.settings.lanes
        lane = choose_lane(
            fixed.lane_fields,
            user=submitter.auth_user,
            user_lane=submitter.lane,
            listener_lane=door.lane,
            lanes=lanes,
            header=self.settings.lane_header,
            asked=submission.lane,
        )
        if lane.refusal:
            log.info("message from %s refused: %s", client, lane.refusal.reason.value)
            return lane.refusal
        if lane.overruled:
            log.info("message from %s stays in lane '%s': %s", client, lane.lane, lane.overruled)
        envelope = model.Envelope(
            org_id=submitter.org_id,
            sender=submission.sender,
            recipients=submission.recipients,
            body=fixed.data,
            listener=door.listener,
            header_message_id=fixed.header_message_id,
            client_ip=door.client_ip,
            client_helo=_printable(door.helo),
            credential_id=submitter.credential_id,
            auth_user=submitter.auth_user,
            received_at=received_at,
            tls_version=door.tls_version,
            tls_cipher=door.tls_cipher,
            duplicate_window=self.settings.limits.duplicate_window
            if fixed.header_message_id != new_message_id
            else 0.0,
            content_key=submission.content_key or fixed.content_digest,
            lane=lane.lane,
            recipient_ids=tuple(new_ids(len(submission.recipients)))
            if submission.recipient_ids
            else (),
            expires_at=intent.expires_at,
            send_at=intent.send_at if intent.send_at and intent.send_at > received_at else None,
            order_key=intent.order_key,
            metadata=intent.metadata or None,
        )
        reception = Reception(queue_id, envelope, auth_param=door.auth_param)
        return Prepared(reception, repeatable=submission.repeatable)

    def _fixups(
        self,
        submission: Submission,
        submitter: Submitter,
        queue_id: uuid.UUID,
        received_at: datetime,
        new_message_id: str,
    ) -> Fixed | Refusal:
        door = submission.door
        limits = self.settings.limits
        trace = Trace(
            hostname=self.settings.server.hostname,
            queue_id=str(queue_id),
            client_ip=door.client_ip or "unknown",
            helo=door.helo,
            esmtp=door.esmtp,
            smtputf8=door.smtputf8,
            tls_version=door.tls_version,
            tls_cipher=door.tls_cipher,
            auth_user=submitter.auth_user,
            recipients=submission.recipients,
            received_at=received_at,
        )
        try:
            return apply_fixups(
                submission.data,
                trace,
                new_message_id=new_message_id,
                max_header_size=limits.max_header_size,
                max_hops=limits.max_hops,
                top=http_trace(trace, door.via) if door.trace == "http" else None,
            )
        except HeaderTooLarge:
            log.info(
                "message from [%s] refused: its header section is over limits.max_header_size "
                "(%d bytes)",
                trace.client_ip,
                limits.max_header_size,
            )
            return Refusal(Reason.HEADER_TOO_LARGE)
        except TooManyHops:
            log.warning(
                "message from [%s] refused: %d or more Received fields (limits.max_hops), "
                "a routing loop?",
                trace.client_ip,
                limits.max_hops,
            )
            return Refusal(Reason.TOO_MANY_HOPS)

    async def commit(self, prepared: Prepared) -> Queued | Refusal:
        """Steps 6-7 of the module docstring."""
        reception = prepared.reception
        envelope = reception.envelope
        task = asyncio.ensure_future(self.group_commit.enqueue(reception.queue_id, envelope))
        try:
            duplicates = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._orphan_outcome(done, reception))
            raise
        except asyncpg.UniqueViolationError as exc:
            if not (prepared.repeatable and exc.constraint_name == "message_pkey"):
                return self._not_queued(reception, exc)
            # A repeat of the submission queued this queue id first: answer as it.
            log.info("message %s was queued by a repeat of its submission", reception.queue_id)
            return Queued(reception.queue_id, envelope, as_sent=False)
        except DB_ERRORS as exc:
            return self._not_queued(reception, exc)
        queue_id = announce(reception, duplicates, delivery_log=self.delivery_log)
        return Queued(queue_id, envelope, as_sent=duplicates is None)

    def _not_queued(self, reception: Reception, exc: BaseException) -> Refusal:
        envelope = reception.envelope
        if is_bad_input(exc):
            # Refused alone (the group commit tries a refused batch one by one): not queued.
            log.info("not queued: the database refused a value of the message: %s", exc)
        else:
            # The commit may have happened with its answer lost: a door must not say "not
            # queued" to a client that can repeat the submission under the same queue id.
            log.warning(
                "not queued or not confirmed: listener=%s client=[%s] user=%s from=<%s> "
                "nrcpt=%d: database trouble: %s",
                envelope.listener,
                envelope.client_ip or "unknown",
                envelope.auth_user or "-",
                envelope.sender,
                len(envelope.recipients),
                exc,
            )
        return Refusal(Reason.COMMIT_FAILED, error=exc)

    def _orphan_outcome(
        self, task: asyncio.Future[Duplicates | None], reception: Reception
    ) -> None:
        """The commit of a message whose client went away while it ran has ended."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.warning(
                "a message whose client went away during the commit was not queued: %s", exc
            )
            return
        queue_id = announce(reception, task.result(), delivery_log=self.delivery_log)
        log.warning("message %s was queued but its client went away before the reply", queue_id)


def http_trace(trace: Trace, via: str = "HTTP") -> bytes:
    """The trace field of HTTP API mail (and an outbox's, `via` "outbox NAME"), where SMTP mail
    has its Received field: from where the message came, when, and its queue id. Which API key sent it is kept in the database and the
    log (`auth_user` apikey:<id>), not told to the recipients, as Postfix keeps the SASL user out
    of its Received field."""
    return (
        f"X-Pigeon-Submitted: by {trace.hostname} (pigeon-mta) over {via}\r\n"
        + (f"\tfrom [{trace.client_ip}]" if trace.client_ip != "unknown" else "\t")
        + f" id {trace.queue_id};\r\n"
        f"\t{format_datetime(trace.received_at)}\r\n"
    ).encode("ascii")


def _database_trouble(exc: BaseException, what: str) -> Refusal:
    if is_bad_input(exc):
        log.info("%s: the database refused a value: %s", what, exc)
    else:
        log.warning("%s: database trouble: %s", what, exc)
    return Refusal(Reason.DATABASE_TROUBLE, error=exc)


def _who(submitter: Submitter) -> str:
    return submitter.auth_user or "a trusted client"


def _printable(text: str | None) -> str | None:
    if text is None:
        return None
    cleaned = "".join(
        c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else "?" for c in text
    )
    return cleaned[:255]
