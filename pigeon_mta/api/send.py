"""`POST /v1/messages`: a message from an application, queued the way SMTP mail is.

In order: the API key (auth.py); the Idempotency-Key; what the request asks to send (compose.py);
the key's rate and the sender policy (policy.py); the fixups of submission/fixups.py, with a trace
field naming the key instead of a Received field; the lane (submission/lanes.py); the group commit
the SMTP listeners of this process share (store/group_commit.py); then, as after an SMTP commit,
`reception.announce` (engines woken, Reception records, the "queued" log line). The 202 is sent
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
import ipaddress
import json
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import format_datetime

import asyncpg
from aiohttp import web

from pigeon_mta import model
from pigeon_mta.api import problems
from pigeon_mta.api.auth import authenticate
from pigeon_mta.api.compose import Submission, from_json, from_raw
from pigeon_mta.api.policy import ApiSenderPolicy
from pigeon_mta.api.problems import Problem
from pigeon_mta.config import API_LISTENER, DEFAULT_LANE, Settings
from pigeon_mta.deliverylog import DeliveryLog
from pigeon_mta.ids import new_id
from pigeon_mta.message import HeaderTooLarge
from pigeon_mta.store import idempotency as store_idempotency
from pigeon_mta.store import queue as store_queue
from pigeon_mta.store.apikeys import ApiKey, auth_user_of
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.duplicates import Duplicates
from pigeon_mta.store.group_commit import GroupCommit
from pigeon_mta.submission.fixups import Fixed, TooManyHops, Trace, apply_fixups
from pigeon_mta.submission.lanes import choose_lane
from pigeon_mta.submission.reception import Reception, announce

log = logging.getLogger("pigeon_mta.api")

JSON = "application/json"
RAW = "message/rfc822"
MAX_IDEMPOTENCY_KEY = 255


class SendHandler:
    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        group_commit: GroupCommit,
        *,
        delivery_log: DeliveryLog | None,
        on_queued: Callable[[int], None],
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.group_commit = group_commit
        self.delivery_log = delivery_log
        self.on_queued = on_queued
        self.policy = ApiSenderPolicy(settings, pool)

    async def post(self, request: web.Request) -> web.Response:
        key = await authenticate(request, self.pool)
        if request.content_type not in (JSON, RAW):
            raise Problem(
                problems.UNSUPPORTED_MEDIA_TYPE,
                f"The Content-Type '{_cut(request.content_type)}' is neither {JSON} nor {RAW}.",
            )
        body = await request.read()
        idempotency_key = _idempotency_key(request)
        request_hash = _request_hash(request, body)
        queue_id = new_id()
        claimed = False
        if idempotency_key is not None:
            earlier = await self._earlier(key, idempotency_key, request_hash)
            if isinstance(earlier, web.Response):
                return earlier
            if earlier is not None:
                queue_id, claimed = earlier, True
        submission = _compose(request, body, self.settings)
        received_at = datetime.now(UTC)
        new_message_id = f"{new_id().hex}@{self.settings.server.hostname}"
        try:
            await self.policy.check_rate(key)
            await self.policy.check_sender(key, submission.sender)
            fixed = self._fixups(request, key, submission, queue_id, received_at, new_message_id)
            await self.policy.check_originators(key, fixed.address_fields)
            lane = self._lane(key, submission, fixed)
            if idempotency_key is not None and not claimed:
                taken = await self._claim(key, idempotency_key, request_hash, queue_id)
                if isinstance(taken, web.Response):
                    return taken
                queue_id = taken
        except DB_ERRORS as exc:
            log.warning("API request of key %s: database trouble: %s", key.id, exc)
            raise problems.database_unavailable("the message was not queued") from None
        # Only a Message-ID the client supplied says "the same message again" (as for SMTP).
        duplicate_window = (
            self.settings.limits.duplicate_window
            if fixed.header_message_id != new_message_id
            else 0.0
        )
        message, reception = _envelope(
            request, key, submission, fixed, lane, queue_id, received_at, duplicate_window
        )
        answered_id = await self._enqueue(key, idempotency_key, message, reception)
        status, response = await self._answer(key, answered_id, submission.recipients)
        if idempotency_key is not None:
            try:
                await store_idempotency.remember_answer(
                    self.pool, key.org_id, idempotency_key, queue_id, status, response
                )
            except DB_ERRORS as exc:
                # A repeat answers from the queued rows instead (see the module docstring).
                log.warning("the answer for the Idempotency-Key of %s is not stored: %s",
                            queue_id, exc)  # fmt: skip
        return _json_response(status, response)

    # ------------------------------------------------------------ Idempotency-Key

    async def _earlier(
        self, key: ApiKey, idempotency_key: str, request_hash: bytes
    ) -> web.Response | uuid.UUID | None:
        """The stored answer to an earlier use of the key, or the queue id of one not yet
        answered, or None for a key not used yet (within the TTL)."""
        try:
            earlier = await store_idempotency.find(self.pool, key.org_id, idempotency_key)
        except DB_ERRORS as exc:
            log.warning("API request of key %s: database trouble: %s", key.id, exc)
            raise problems.database_unavailable(
                "the Idempotency-Key could not be looked up"
            ) from None
        return _replay(earlier, request_hash)

    async def _claim(
        self, key: ApiKey, idempotency_key: str, request_hash: bytes, queue_id: uuid.UUID
    ) -> web.Response | uuid.UUID:
        """The queue id to queue under: ours when the claim is, else that of the request that
        claimed the key first (or its stored answer)."""
        earlier = await store_idempotency.claim(
            self.pool, key.org_id, idempotency_key, request_hash, queue_id
        )
        if earlier is None:
            return queue_id
        replayed = _replay(earlier, request_hash)
        assert replayed is not None
        return replayed

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
            client_ip=_client_ip(request) or "unknown",
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
                top=api_trace(trace, key),
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
        if submission.lane is not None and submission.lane.strip().lower() not in lanes:
            known = ", ".join(sorted(lanes))
            raise Problem(
                problems.UNKNOWN_LANE,
                f"The lane '{_cut(submission.lane)}' in 'lane' is not a lane of the server "
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
        idempotency_key: str | None,
        message: model.Envelope,
        reception: Reception,
    ) -> uuid.UUID:
        """Commit the message (as the SMTP handler does, shielded: a client that goes away does
        not cancel the commit half-way); returns the queue id to answer with."""
        task = asyncio.ensure_future(self.group_commit.enqueue(reception.queue_id, message))
        try:
            duplicates = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._orphan_outcome(done, message, reception))
            raise
        except asyncpg.UniqueViolationError:
            # A repeat with the same Idempotency-Key queued this queue id first: answer as it.
            log.info("message %s was queued by a repeat of its request", reception.queue_id)
            return reception.queue_id
        except DB_ERRORS as exc:
            log.warning(
                "not queued (503 sent): key=%s from=<%s> nrcpt=%d: database trouble: %s",
                key.id,
                message.sender,
                len(message.recipients),
                exc,
            )
            if idempotency_key is not None:
                await self._forget(key, idempotency_key, reception.queue_id)
            raise problems.database_unavailable("the message was not queued") from None
        return self._announce(message, reception, duplicates)

    def _announce(
        self, message: model.Envelope, reception: Reception, duplicates: Duplicates | None
    ) -> uuid.UUID:
        return announce(
            message,
            reception,
            duplicates,
            delivery_log=self.delivery_log,
            on_queued=self.on_queued,
        )

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

    async def _forget(self, key: ApiKey, idempotency_key: str, queue_id: uuid.UUID) -> None:
        try:
            await store_idempotency.forget(self.pool, key.org_id, idempotency_key, queue_id)
        except DB_ERRORS:
            pass  # a repeat finds no message under the claimed id and queues it then

    async def _answer(
        self, key: ApiKey, queue_id: uuid.UUID, recipients: tuple[str, ...]
    ) -> tuple[int, bytes]:
        """The 202 and its body, from the queued rows (the recipient ids are made at the
        commit). Should the rows not be readable after the commit, the ids are null: the
        message is queued, and saying otherwise would make the client send it again."""
        try:
            queued = await store_queue.queued_recipients(self.pool, key.org_id, queue_id)
        except DB_ERRORS as exc:
            log.warning("message %s is queued but its recipients were not read: %s", queue_id, exc)
            queued = None
        order = {address: i for i, address in enumerate(recipients)}
        message_id, rows = queued if queued is not None else (None, [])
        ids = {address: recipient_id for recipient_id, address in rows}
        listed = sorted(ids, key=lambda a: order.get(a, len(order))) if ids else list(recipients)
        body = {
            "queue_id": str(queue_id),
            "message_id": message_id,
            "recipients": [{"address": a, "id": str(ids[a]) if a in ids else None} for a in listed],
        }
        return 202, json.dumps(body).encode()


def _compose(request: web.Request, body: bytes, settings: Settings) -> Submission:
    if request.content_type == JSON:
        return from_json(body, settings.limits)
    return from_raw(
        body, request.query.getall("from", []), request.query.getall("to", []), settings.limits
    )


def _replay(
    earlier: store_idempotency.Remembered | None, request_hash: bytes
) -> web.Response | uuid.UUID | None:
    if earlier is None:
        return None
    if earlier.request_hash != request_hash:
        raise Problem(
            problems.IDEMPOTENCY_KEY_REUSED,
            "The Idempotency-Key header was used within 24 hours for a request with another "
            "body or query.",
        )
    if earlier.status is not None and earlier.response is not None:
        return _json_response(earlier.status, earlier.response)
    return earlier.queue_id


def _envelope(
    request: web.Request,
    key: ApiKey,
    submission: Submission,
    fixed: Fixed,
    lane: str,
    queue_id: uuid.UUID,
    received_at: datetime,
    duplicate_window: float,
) -> tuple[model.Envelope, Reception]:
    client_ip = _client_ip(request)
    tls_version, tls_cipher = _tls(request)
    auth_user = auth_user_of(key.id)
    message = model.Envelope(
        org_id=key.org_id,
        sender=str(submission.sender),
        recipients=submission.recipients,
        body=fixed.data,
        listener=API_LISTENER,
        header_message_id=fixed.header_message_id,
        client_ip=client_ip,
        auth_user=auth_user,
        received_at=received_at,
        tls_version=tls_version,
        tls_cipher=tls_cipher,
        duplicate_window=duplicate_window,
        lane=lane,
    )
    reception = Reception(
        queue_id=queue_id,
        org_id=key.org_id,
        listener=API_LISTENER,
        client_ip=client_ip or "unknown",
        helo=None,
        auth_user=auth_user,
        sender=str(submission.sender),
        recipients=submission.recipients,
        size=len(fixed.data),
        header_message_id=fixed.header_message_id,
        tls=f"{tls_version} {tls_cipher}" if tls_version else None,
        received_at=received_at,
        lane=lane,
    )
    return message, reception


def api_trace(trace: Trace, key: ApiKey) -> bytes:
    """The trace field of API mail, in place of an SMTP Received field: who sent it (the key's
    id, never the key), from where, when, and its queue id."""
    return (
        f"X-Pigeon-Submitted: by {trace.hostname} (pigeon-mta) over HTTP\r\n"
        f"\tfrom [{trace.client_ip}] with API key {key.id} id {trace.queue_id};\r\n"
        f"\t{format_datetime(trace.received_at)}\r\n"
    ).encode("ascii")


def _idempotency_key(request: web.Request) -> str | None:
    value = request.headers.get("Idempotency-Key")
    if value is None:
        return None
    if not 0 < len(value) <= MAX_IDEMPOTENCY_KEY or not all(" " <= c <= "~" for c in value):
        raise Problem(
            problems.INVALID_HEADER,
            f"The Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII "
            "characters.",
        )
    return value


def _request_hash(request: web.Request, body: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in (request.method, request.path, request.query_string, request.content_type):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\0")
    digest.update(body)
    return digest.digest()


def _client_ip(request: web.Request) -> str | None:
    try:
        return str(ipaddress.ip_address(request.remote or ""))
    except ValueError:
        return None


def _tls(request: web.Request) -> tuple[str | None, str | None]:
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None, None
    cipher = ssl_object.cipher()
    return ssl_object.version(), cipher[0] if cipher else None


def _json_response(status: int, body: bytes) -> web.Response:
    response = web.Response(status=status, body=body)
    response.headers["Content-Type"] = JSON
    return response


def _cut(text: str, limit: int = 64) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
