"""`pigeon-mta log REF` prints what clients and remote servers sent with its control characters
escaped: a HELO name or a reply text cannot drive the operator's terminal."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg

from pigeon_mta.model import AttemptResult, Envelope, Outcome, Reply
from pigeon_mta.store.queue import enqueue
from tests.integration.queue_helpers import claim, record_attempts
from tests.integration.test_message_log import pigeon_log

HELO = "evil.example\x1b[2J\rforged"
REPLY_TEXT = "No such user\x1b]0;owned\x07"


async def test_hostile_helo_and_reply_text_are_escaped(
    pool: asyncpg.Pool, org_id: uuid.UUID, db_url: str
) -> None:
    envelope = Envelope(
        org_id=org_id,
        sender="alice@example.com",
        recipients=("bob@example.net",),
        body=b"Subject: hi\r\n\r\nhello\r\n",
        listener="relay",
        header_message_id=None,
        client_ip="192.0.2.7",
        client_helo=HELO,
        auth_user=None,
    )
    queue_id = await enqueue(pool, envelope)
    (delivery,) = await claim(pool, owner="test-node", lease=60, batch=10)
    (recipient,) = delivery.recipients
    await record_attempts(
        pool,
        [
            AttemptResult(
                recipient_id=recipient.id,
                queue_id=delivery.queue_id,
                org_id=delivery.org_id,
                attempt=recipient.attempts,
                outcome=Outcome.BOUNCED,
                reply=Reply(550, "5.1.1", REPLY_TEXT),
                started_at=datetime.now(UTC),
                duration=0.1,
                next_attempt_at=None,
                mx_host="mx.example.net",
                ip="198.51.100.1",
                port=25,
                tls_version=None,
                tls_cipher=None,
            )
        ],
    )

    code, out, err = await pigeon_log(db_url, str(queue_id))
    assert code == 0, err
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "(HELO evil.example\\x1b[2J\\rforged)" in out
    assert "No such user\\x1b]0;owned\\x07" in out
