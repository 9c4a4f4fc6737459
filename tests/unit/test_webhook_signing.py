"""Webhook signing and the sender's judgement of a reply: pure functions, checked against the
`standardwebhooks` package and by tables."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from pigeon_mta.backoff import backoff_delay
from pigeon_mta.config import Duration, WebhookSettings
from pigeon_mta.store.webhooks import ClaimedEvent
from pigeon_mta.webhooks.sender import HttpReply, judge
from pigeon_mta.webhooks.signing import SECRET_PREFIX, new_secret, secret_key, signed_headers


def test_secrets_are_standard_webhooks_secrets_of_32_random_bytes() -> None:
    first, second = new_secret(), new_secret()
    assert first.startswith(SECRET_PREFIX) and first != second
    assert len(secret_key(first)) == 32


def test_signed_headers_verify_with_the_standardwebhooks_package() -> None:
    secret = new_secret()
    body = b'{"type": "delivered", "data": {"recipient": "b\\u00f6b@example.net"}}'
    headers = signed_headers(secret, "evt-1", body)
    assert Webhook(secret).verify(body, headers) is not None
    assert headers["webhook-signature"].startswith("v1,")
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body + b" ", headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)


def event(created_at: datetime, attempts: int) -> ClaimedEvent:
    return ClaimedEvent(uuid.uuid4(), uuid.uuid4(), "http://x/", "s", b"{}", attempts, created_at)


SETTINGS = WebhookSettings(
    max_age=Duration(3600), retry_initial=Duration(10), retry_max=Duration(600)
)


@pytest.mark.parametrize(
    ("reply", "age", "attempts", "state"),
    [
        (HttpReply(200, None), 0, 1, "delivered"),
        (HttpReply(204, None), 4000, 9, "delivered"),  # a late success still counts
        (HttpReply(500, "HTTP 500"), 0, 1, "pending"),
        (HttpReply(302, "HTTP 302 Found"), 0, 1, "pending"),  # redirects are not followed
        (HttpReply(None, "no reply within 10s"), 0, 1, "pending"),
        (HttpReply(500, "HTTP 500"), 3595, 1, "failed"),  # the next try would be too late
        (HttpReply(None, "refused"), 3200, 8, "failed"),  # 450s at least (capped): too late
    ],
)
def test_judge_retries_until_max_age(
    reply: HttpReply, age: float, attempts: int, state: str
) -> None:
    now = datetime.now(UTC)
    result = judge(event(now - timedelta(seconds=age), attempts), reply, settings=SETTINGS, now=now)
    assert result.state == state
    assert (result.next_attempt_at is not None) == (state == "pending")
    assert result.status == reply.status


def test_the_retry_delay_of_an_event_doubles_with_jitter_up_to_the_maximum() -> None:
    rng = random.Random(7)
    for attempts, base in [(1, 10), (2, 20), (3, 40), (7, 600), (50, 600)]:
        delays = [backoff_delay(attempts, 10, 600, rng) for _ in range(200)]
        assert max(10, base * 0.75) <= min(delays) < max(delays) <= min(600, base * 1.25)
