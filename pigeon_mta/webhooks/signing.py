"""Standard Webhooks signing (https://www.standardwebhooks.com, "Signature scheme"): secrets and the
three headers that a receiver checks.

The signature is HMAC-SHA256, keyed with the secret's bytes, over "<webhook-id>.<webhook-timestamp>.
<body>", sent as "v1,<base64>". A receiver compares it in constant time and refuses old timestamps
(replays); `webhook-id` lets it drop the repeats that at-least-once sending makes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

SECRET_PREFIX = "whsec_"
# The specification asks for 24 to 64 random bytes.
SECRET_BYTES = 32


def new_secret() -> str:
    """A signing secret in the Standard Webhooks format: "whsec_" and base64 of random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret (its base64 part decoded)."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value of one request."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


def signed_headers(
    secret: str, webhook_id: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """The headers of one request: id, timestamp (Unix seconds) and signature."""
    timestamp = int(time.time() if now is None else now)
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret_key(secret), webhook_id, timestamp, body),
    }
