"""What API mail is queued as: its envelope and Reception (as the SMTP handler builds them from
a session), and the trace field that stands where SMTP mail has its Received field."""

from __future__ import annotations

import ipaddress
import uuid
from datetime import datetime
from email.utils import format_datetime

from aiohttp import web

from pigeon_mta import model
from pigeon_mta.api.compose import Submission
from pigeon_mta.config import API_LISTENER
from pigeon_mta.ids import new_ids
from pigeon_mta.store.apikeys import ApiKey, auth_user_of
from pigeon_mta.submission.fixups import Fixed, Trace
from pigeon_mta.submission.reception import Reception


def api_trace(trace: Trace) -> bytes:
    """From where the message came, when, and its queue id. Which API key sent it is kept in the
    database and the log (`auth_user` apikey:<id>), not told to the recipients, as Postfix keeps
    the SASL user out of its Received field."""
    return (
        f"X-Pigeon-Submitted: by {trace.hostname} (pigeon-mta) over HTTP\r\n"
        f"\tfrom [{trace.client_ip}] id {trace.queue_id};\r\n"
        f"\t{format_datetime(trace.received_at)}\r\n"
    ).encode("ascii")


def queued_as(
    request: web.Request,
    key: ApiKey,
    submission: Submission,
    fixed: Fixed,
    *,
    lane: str,
    queue_id: uuid.UUID,
    received_at: datetime,
    duplicate_window: float,
    content_key: bytes | None = None,
) -> tuple[model.Envelope, Reception]:
    ip = client_ip(request)
    tls_version, tls_cipher = _tls(request)
    auth_user = auth_user_of(key.id)
    message = model.Envelope(
        org_id=key.org_id,
        sender=str(submission.sender),
        recipients=submission.recipients,
        body=fixed.data,
        listener=API_LISTENER,
        header_message_id=fixed.header_message_id,
        client_ip=ip,
        auth_user=auth_user,
        received_at=received_at,
        tls_version=tls_version,
        tls_cipher=tls_cipher,
        duplicate_window=duplicate_window,
        content_key=content_key,
        lane=lane,
        recipient_ids=tuple(new_ids(len(submission.recipients))),
    )
    reception = Reception(
        queue_id=queue_id,
        org_id=key.org_id,
        listener=API_LISTENER,
        client_ip=ip or "unknown",
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


def client_ip(request: web.Request) -> str | None:
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
