"""`POST /v1/messages`: a message from an application, queued the way SMTP mail is.

In order: the API key (auth.py); the Idempotency-Key; what the request asks to send (compose.py);
the key's rate and the sender policy (policy.py); the fixups of submission/fixups.py, with a trace
field naming the key instead of a Received field; the lane (submission/lanes.py); the group commit
the SMTP listeners of this process share (store/group_commit.py); then, as after an SMTP commit,
`reception.announce` (Reception records, the "queued" log line; the group commit has handed the
message to this process's engine or woken the engines). The 202 is sent
only after the commit.

An Idempotency-Key is claimed (store/idempotency.py) just before the enqueue, with the queue id
the message will have. A repeat finds the answer stored after the commit; if the first request
is still under way, or died between its commit and storing its answer, the repeat queues under
the same queue id, which the message's primary key lets only one of them do, and answers from
the queued rows: the same body either way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from datetime import UTC, datetime

import asyncpg
from aiohttp import web

from pigeon_mta import model
from pigeon_mta.api import problems
from pigeon_mta.api.auth import Authenticator
from pigeon_mta.api.compose import Submission, from_json, from_raw
from pigeon_mta.api.envelope import api_trace, client_ip, queued_as
from pigeon_mta.api.idempotency import Idempotency, json_response
from pigeon_mta.api.policy import ApiSenderPolicy
from pigeon_mta.api.problems import Problem, shown
from pigeon_mta.config import DEFAULT_LANE, Settings
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.ids import new_id
from pigeon_mta.message import HeaderTooLarge
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store.apikeys import ApiKey, auth_user_of
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.duplicates import Duplicates
from pigeon_mta.store.errors import is_bad_input
from pigeon_mta.store.group_commit import GroupCommit
from pigeon_mta.submission.fixups import Fixed, TooManyHops, Trace, apply_fixups
from pigeon_mta.submission.lanes import choose_lane
from pigeon_mta.submission.reception import Reception, announce

log = logging.getLogger("pigeon_mta.api")

JSON = "application/json"
RAW = "message/rfc822"
# A commit that failed may have happened all the same, its answer lost with the connection.
_NOT_CONFIRMED = (
    "the message may not be queued: send the request again (with the same Idempotency-Key it is "
    "queued at most once)"
)


class SendHandler:
    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        group_commit: GroupCommit,
        authenticate: Authenticator,
        *,
        delivery_log: DeliveryLog | None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.group_commit = group_commit
        self.authenticate = authenticate
        self.delivery_log = delivery_log
        self.policy = ApiSenderPolicy(settings, pool)

    async def post(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        if request.content_type not in (JSON, RAW):
            raise Problem(
                problems.UNSUPPORTED_MEDIA_TYPE,
                f"The Content-Type '{shown(request.content_type)}' is neither {JSON} nor {RAW}.",
            )
        body = await request.read()
        idempotency = Idempotency.of(request, body, self.pool, key.org_id)
        queue_id = new_id()
        claimed = False
        if idempotency is not None:
            earlier = await idempotency.earlier()
            if isinstance(earlier, web.Response):
                return earlier
            if earlier is not None:
                queue_id, claimed = earlier, True
        submission = _compose(request, body, self.settings)
        received_at = datetime.now(UTC)
        new_message_id = f"{new_id().hex}@{self.settings.server.hostname}"
        try:
            await self.policy.check_rate(key)
            owned: dict[str, bool] = {}  # the org's sender domains, as far as this request asked
            await self.policy.check_sender(key, submission.sender, owned)
            fixed = self._fixups(request, key, submission, queue_id, received_at, new_message_id)
            await self.policy.check_originators(key, fixed.address_fields, owned)
            lane = self._lane(key, submission, fixed)
            if idempotency is not None and not claimed:
                taken = await idempotency.claim(queue_id)
                if isinstance(taken, web.Response):
                    return taken
                queue_id = taken
        except DB_ERRORS as exc:
            raise problems.database_error(
                exc, "the message was not queued", f"API request of key {key.id}"
            ) from None
        message, reception = queued_as(
            request,
            key,
            submission,
            fixed,
            lane=lane,
            queue_id=queue_id,
            received_at=received_at,
            # Only a Message-ID the client supplied says "the same message again" (as for SMTP).
            duplicate_window=self.settings.limits.duplicate_window
            if fixed.header_message_id != new_message_id
            else 0.0,
            # The request as the client sent it: a retry sends the same bytes.
            content_key=hashlib.blake2b(body, digest_size=16).digest(),
        )
        answered_id, as_sent = await self._enqueue(key, idempotency, message, reception)
        if as_sent:
            status, response = 202, _accepted(answered_id, message)
        else:
            status, response = await self._answer(key, answered_id, submission.recipients)
        if idempotency is not None:
            await idempotency.remember(queue_id, status, response)
        return json_response(status, response)

    # ------------------------------------------------------------ the message

    def _fixups(
        self,
        request: web.Request,
        key: ApiKey,
        submission: Submission,
        queue_id: uuid.UUID,
        received_at: datetime,
        new_message_id: str,
    ) -> Fixed:
        hostname = self.settings.server.hostname
        limits = self.settings.limits
        trace = Trace(
            hostname=hostname,
            queue_id=str(queue_id),
            client_ip=client_ip(request) or "unknown",
            helo=None,
            esmtp=True,
            smtputf8=False,
            tls_version=None,
            tls_cipher=None,
            auth_user=auth_user_of(key.id),
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
                top=api_trace(trace),
            )
        except HeaderTooLarge:
            raise Problem(
                problems.TOO_LARGE,
                "The header section of the message is over limits.max_header_size "
                f"({limits.max_header_size} bytes).",
            ) from None
        except TooManyHops:
            raise Problem(
                problems.INVALID_MESSAGE,
                f"The message has {limits.max_hops} or more Received fields (limits.max_hops): "
                "a routing loop?",
            ) from None

    def _lane(self, key: ApiKey, submission: Submission, fixed: Fixed) -> str:
        lanes = self.settings.lanes
        header = self.settings.lane_header
        if (
            header != "off"
            and submission.lane is not None
            and submission.lane.strip().lower() not in lanes
        ):
            known = ", ".join(sorted(lanes))
            raise Problem(
                problems.UNKNOWN_LANE,
                f"The lane '{shown(submission.lane)}' in 'lane' is not a lane of the server "
                f"(lanes: {known}).",
            )
        fields = (submission.lane,) if submission.lane is not None else fixed.lane_fields
        # A key whose lane the settings no longer have sends in the default lane (as a user's
        # does, submission/lanes.py).
        choice = choose_lane(
            fields,
            user=None,
            user_lane=key.lane if key.lane in lanes else None,
            listener_lane="",
            lanes=lanes,
            header=header,
        )
        if choice.overruled:
            log.info(
                "API request of key %s stays in lane '%s': %s",
                key.id,
                choice.lane,
                choice.overruled,
            )
        if choice.refusal:
            raise Problem(
                problems.UNKNOWN_LANE,
                "The X-Pigeon-Lane fields of the message name a lane the server does not have, "
                "or several lanes.",
            )
        return choice.lane or DEFAULT_LANE

    async def _enqueue(
        self,
        key: ApiKey,
        idempotency: Idempotency | None,
        message: model.Envelope,
        reception: Reception,
    ) -> tuple[uuid.UUID, bool]:
        """Commit the message (as the SMTP handler does, shielded: a client that goes away does
        not cancel the commit half-way); returns the queue id to answer with, and whether the
        message was queued as sent (no recipient a duplicate, not queued first by a repeat): its
        rows are then the envelope's, and the answer needs no read-back."""
        task = asyncio.ensure_future(self.group_commit.enqueue(reception.queue_id, message))
        try:
            duplicates = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._orphan_outcome(done, message, reception))
            raise
        except asyncpg.UniqueViolationError as exc:
            if idempotency is None or exc.constraint_name != "message_pkey":
                raise  # not a repeat: a fault, answered 500 and logged by the server
            # A repeat with the same Idempotency-Key queued this queue id first: answer as it.
            log.info("message %s was queued by a repeat of its request", reception.queue_id)
            return reception.queue_id, False
        except DB_ERRORS as exc:
            if is_bad_input(exc):
                # Refused alone (the group commit tries a refused batch one by one): not queued.
                raise problems.database_error(
                    exc, "the message was not queued", f"API request of key {key.id}"
                ) from None
            log.warning(
                "not confirmed (503 sent): key=%s from=<%s> nrcpt=%d: database trouble: %s",
                key.id,
                message.sender,
                len(message.recipients),
                exc,
            )
            # An Idempotency-Key keeps its claim: the commit may have happened with its answer
            # lost (a connection broken during it), and a repeat then finds the message by its id.
            # So the answer cannot say "not queued".
            raise problems.database_unavailable(_NOT_CONFIRMED) from None
        return self._announce(message, reception, duplicates), duplicates is None

    def _announce(
        self, message: model.Envelope, reception: Reception, duplicates: Duplicates | None
    ) -> uuid.UUID:
        return announce(message, reception, duplicates, delivery_log=self.delivery_log)

    def _orphan_outcome(
        self,
        task: asyncio.Future[Duplicates | None],
        message: model.Envelope,
        reception: Reception,
    ) -> None:
        """The commit of a message whose request was cancelled while it ran has ended."""
        if task.cancelled() or task.exception() is not None:
            return
        self._announce(message, reception, task.result())

    async def _answer(
        self, key: ApiKey, queue_id: uuid.UUID, recipients: tuple[str, ...]
    ) -> tuple[int, bytes]:
        """The 202 and its body, from the queued rows, for a message not queued as sent (its
        recipients were duplicates, or a repeat of the request queued it). Should the rows not be
        readable after the commit, the ids are null: the message is queued, and saying otherwise
        would make the client send it again."""
        try:
            queued = await store_queue.queued_recipients(self.pool, key.org_id, queue_id)
        except DB_ERRORS as exc:
            log.warning("message %s is queued but its recipients were not read: %s", queue_id, exc)
            queued = None
        order = {address: i for i, address in enumerate(recipients)}
        message_id, rows = queued if queued is not None else (None, [])
        ids: dict[str, uuid.UUID | None] = {address: recipient_id for recipient_id, address in rows}
        if ids:
            ids = dict(sorted(ids.items(), key=lambda item: order.get(item[0], len(order))))
        else:
            ids = dict.fromkeys(recipients)
        return 202, _body(queue_id, message_id, ids)


def _accepted(queue_id: uuid.UUID, message: model.Envelope) -> bytes:
    """The 202's body for a message queued as sent, from its envelope: the same as `_answer`
    reads back (each address once, in the request's order)."""
    ids: dict[str, uuid.UUID | None] = {}
    for address, recipient_id in zip(message.recipients, message.recipient_ids, strict=True):
        ids.setdefault(address, recipient_id)
    return _body(queue_id, message.header_message_id, ids)


def _body(queue_id: uuid.UUID, message_id: str | None, ids: dict[str, uuid.UUID | None]) -> bytes:
    """`{queue_id, message_id, recipients: [{address, id}]}`, the recipients in `ids`' order."""
    return json.dumps(
        {
            "queue_id": str(queue_id),
            "message_id": message_id,
            "recipients": [
                {"address": a, "id": str(i) if i is not None else None} for a, i in ids.items()
            ],
        }
    ).encode()


def _compose(request: web.Request, body: bytes, settings: Settings) -> Submission:
    if request.content_type == JSON:
        return from_json(body, settings.limits)
    return from_raw(
        body, request.query.getall("from", []), request.query.getall("to", []), settings.limits
    )
