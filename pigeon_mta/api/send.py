"""`POST /v1/messages`: a message from an application, queued through the intake as SMTP mail is.

In order: the API key (auth.py); the Idempotency-Key; what the request asks to send (compose.py);
then the intake (intake/accept.py): the sender policy and the key's rate, the fixups with an
X-Pigeon-Submitted field where SMTP mail has its Received field, the lane, the group commit the
SMTP listeners of this process share, and the announcement. The 202 is sent only after the
commit; a refusal is answered with its problem type (`problem_of`).

An Idempotency-Key is claimed (store/idempotency.py) between the intake's prepare and commit,
with the queue id the message will have. A repeat finds the answer stored after the commit; if
the first request is still under way, or died between its commit and storing its answer, the
repeat queues under the same queue id, which the message's primary key lets only one of them do,
and answers from the queued rows: the same body either way.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import uuid

import asyncpg
from aiohttp import web

from pigeon_mta import model
from pigeon_mta.api import problems
from pigeon_mta.api.auth import Authenticator
from pigeon_mta.api.compose import Composed, from_json, from_raw
from pigeon_mta.api.idempotency import Idempotency, json_response
from pigeon_mta.api.problems import Problem, shown
from pigeon_mta.config import API_LISTENER, Settings
from pigeon_mta.intake.accept import Intake, Prepared
from pigeon_mta.intake.refusal import Reason, Refusal
from pigeon_mta.intake.submission import Door, Submission, Submitter
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store.apikeys import ApiKey, auth_user_of
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.errors import is_bad_input

log = logging.getLogger("pigeon_mta.api")

JSON = "application/json"
RAW = "message/rfc822"
# A commit that failed may have happened all the same, its answer lost with the connection.
_NOT_CONFIRMED = (
    "the message may not be queued: send the request again (with the same Idempotency-Key it is "
    "queued at most once)"
)
# What a client is told to wait when its key is over its rate (at most the window).
_RATE_RETRY_AFTER = 60

_FIELD_NAMES = {
    "from": "From",
    "sender": "Sender",
    "resent-from": "Resent-From",
    "resent-sender": "Resent-Sender",
}


class SendHandler:
    def __init__(
        self, settings: Settings, pool: asyncpg.Pool, intake: Intake, authenticate: Authenticator
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.intake = intake
        self.authenticate = authenticate

    async def post(self, request: web.Request) -> web.Response:
        key = await self.authenticate(request)
        if request.content_type not in (JSON, RAW):
            raise Problem(
                problems.UNSUPPORTED_MEDIA_TYPE,
                f"The Content-Type '{shown(request.content_type)}' is neither {JSON} nor {RAW}.",
            )
        body = await request.read()
        idempotency = Idempotency.of(request, body, self.pool, key.org_id)
        queue_id = None
        if idempotency is not None:
            earlier = await idempotency.earlier()
            if isinstance(earlier, web.Response):
                return earlier
            queue_id = earlier
        composed = _compose(request, body, self.settings)
        claimed = queue_id is not None
        submission = Submission(
            door=_door(request),
            submitter=Submitter(
                org_id=key.org_id,
                org=key.org,
                auth_user=auth_user_of(key.id),
                api_key=True,
                lane=key.lane,
            ),
            sender=str(composed.sender),
            recipients=composed.recipients,
            data=composed.data,
            lane=composed.lane,
            intent=composed.intent,
            # The request as the client sent it: a retry sends the same bytes.
            content_key=hashlib.blake2b(body, digest_size=16).digest(),
            queue_id=queue_id,
            repeatable=idempotency is not None,
            recipient_ids=True,
        )
        prepared = await self.intake.prepare(submission)
        if isinstance(prepared, Refusal):
            raise problem_of(prepared, key.org, composed, self.settings)
        if idempotency is not None and not claimed:
            taken = await self._claim(key, idempotency, prepared)
            if isinstance(taken, web.Response):
                return taken
            prepared = taken
        queued = await self.intake.commit(prepared)
        if isinstance(queued, Refusal):
            raise problem_of(queued, key.org, composed, self.settings)
        if queued.as_sent:
            status, response = 202, _accepted(queued.queue_id, queued.envelope)
        else:
            status, response = await self._answer(key, queued.queue_id, composed.recipients)
        if idempotency is not None:
            await idempotency.remember(prepared.queue_id, status, response)
        return json_response(status, response)

    async def _claim(
        self, key: ApiKey, idempotency: Idempotency, prepared: Prepared
    ) -> Prepared | web.Response:
        try:
            taken = await idempotency.claim(prepared.queue_id)
        except DB_ERRORS as exc:
            raise problems.database_error(
                exc, "the message was not queued", f"API request of key {key.id}"
            ) from None
        if isinstance(taken, web.Response):
            return taken
        return prepared.with_queue_id(taken)

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
        header_message_id, rows = queued if queued is not None else (None, [])
        ids: dict[str, uuid.UUID | None] = {address: recipient_id for recipient_id, address in rows}
        if ids:
            ids = dict(sorted(ids.items(), key=lambda item: order.get(item[0], len(order))))
        else:
            ids = dict.fromkeys(recipients)
        return 202, _body(queue_id, header_message_id, ids)


def _accepted(queue_id: uuid.UUID, message: model.Envelope) -> bytes:
    """The 202's body for a message queued as sent, from its envelope: the same as `_answer`
    reads back (each address once, in the request's order)."""
    ids: dict[str, uuid.UUID | None] = {}
    for address, recipient_id in zip(message.recipients, message.recipient_ids, strict=True):
        ids.setdefault(address, recipient_id)
    return _body(queue_id, message.header_message_id, ids)


def _body(
    queue_id: uuid.UUID, header_message_id: str | None, ids: dict[str, uuid.UUID | None]
) -> bytes:
    """`{queue_id, message_id, recipients: [{address, id}]}`, the recipients in `ids`' order."""
    return json.dumps(
        {
            "queue_id": str(queue_id),
            "message_id": header_message_id,
            "recipients": [
                {"address": a, "id": str(i) if i is not None else None} for a, i in ids.items()
            ],
        }
    ).encode()


def _compose(request: web.Request, body: bytes, settings: Settings) -> Composed:
    if request.content_type == JSON:
        return from_json(body, settings.limits)
    return from_raw(
        body, request.query.getall("from", []), request.query.getall("to", []), settings.limits
    )


def _door(request: web.Request) -> Door:
    try:
        client_ip: str | None = str(ipaddress.ip_address(request.remote or ""))
    except ValueError:
        client_ip = None
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    tls_version = tls_cipher = None
    if ssl_object is not None:
        cipher = ssl_object.cipher()
        tls_version, tls_cipher = ssl_object.version(), cipher[0] if cipher else None
    return Door(
        listener=API_LISTENER,
        client_ip=client_ip,
        tls_version=tls_version,
        tls_cipher=tls_cipher,
        trace="http",
    )


def problem_of(refusal: Refusal, org: str, composed: Composed, settings: Settings) -> Problem:
    """The problem an intake's refusal of `org`'s message is answered with (the outbox relay
    writes its detail to a refused row)."""
    reason = refusal.reason
    field = _FIELD_NAMES.get(refusal.field or "", "")
    limits = settings.limits
    if reason is Reason.SENDER_NOT_OWNED:
        return Problem(
            problems.SENDER_NOT_OWNED,
            f"The sender '{composed.sender}' in 'from' is not at one of the sender domains of "
            f"the org '{org}'.",
        )
    if reason is Reason.FIELD_NOT_OWNED:
        return Problem(
            problems.SENDER_NOT_OWNED,
            f"The {field}: field names @{refusal.domain}, which is not a sender domain of the "
            f"org '{org}'.",
        )
    if reason is Reason.FIELD_UNREADABLE:
        assert refusal.problem is not None
        return Problem(
            problems.INVALID_HEADER, f"The {field}: field of the message {refusal.problem.value}."
        )
    if reason is Reason.NO_FROM:
        return Problem(problems.INVALID_HEADER, "The message has no From: address.")
    if reason is Reason.RATE_LIMITED:
        window = limits.credential_rate_window
        return Problem(
            problems.RATE_LIMITED,
            f"The API key has sent {refusal.recent} messages within "
            f"limits.credential_rate_window ({window:g}s), as many as "
            "limits.credential_rate_limit allows.",
            retry_after=int(min(_RATE_RETRY_AFTER, window)) or 1,
        )
    if reason is Reason.HEADER_TOO_LARGE:
        return Problem(
            problems.TOO_LARGE,
            "The header section of the message is over limits.max_header_size "
            f"({limits.max_header_size} bytes).",
        )
    if reason is Reason.TOO_MANY_HOPS:
        return Problem(
            problems.INVALID_MESSAGE,
            f"The message has {limits.max_hops} or more Received fields (limits.max_hops): "
            "a routing loop?",
        )
    if reason is Reason.UNKNOWN_LANE and refusal.asked_by_request:
        known = ", ".join(sorted(settings.lanes))
        return Problem(
            problems.UNKNOWN_LANE,
            f"The lane '{shown(composed.lane or '')}' in 'lane' is not a lane of the server "
            f"(lanes: {known}).",
        )
    if reason is Reason.BAD_INTENT:
        return Problem(
            problems.INVALID_HEADER,
            f"The {shown(refusal.intent_field)} field of the message {refusal.intent_problem}.",
        )
    if reason in (Reason.UNKNOWN_LANE, Reason.LANES_DIFFER):
        return Problem(
            problems.UNKNOWN_LANE,
            "The X-Pigeon-Lane fields of the message name a lane the server does not have, "
            "or several lanes.",
        )
    assert refusal.error is not None
    if reason is Reason.COMMIT_FAILED and not is_bad_input(refusal.error):
        # The commit may have happened with its answer lost: a repeat (with the same
        # Idempotency-Key, which keeps its claim) finds the message by its id.
        return problems.database_unavailable(_NOT_CONFIRMED)
    # The intake logged it, with the submitter and the client.
    return problems.database_error(refusal.error, "the message was not queued", None)
