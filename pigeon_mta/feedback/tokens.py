"""VERP tokens: the envelope sender `b-TOKEN@RETURN-PATH-DOMAIN` names the recipient row a bounce
or a complaint is about.

A token is the key's byte, the recipient id (16 bytes) and the first 8 bytes of an HMAC-SHA256 of
both under that key: 25 bytes, 40 characters of lower-case base32 (RFC 4648, no padding). Local
parts are compared without regard to case by many a mail system, and base32 survives that. The
MAC makes a token impossible to forge or to enumerate without the key (2^64 tries per guess);
keys live in the database (store/return_path.py), are rotated by `pigeon-mta feedback rotate-key`,
and a retired key verifies its tokens for `[bounces] feedback_max_age` more.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "b-"
_MAC_BYTES = 8
_TOKEN_BYTES = 1 + 16 + _MAC_BYTES
TOKEN_LENGTH = _TOKEN_BYTES * 8 // 5  # 40
_DOMAIN_SEPARATION = b"pigeon-mta return-path v1\0"


@dataclass(frozen=True)
class SigningKey:
    id: int  # 0..255, the token's first byte
    secret: bytes  # 32 bytes


def _mac(key: SigningKey, recipient_id: uuid.UUID) -> bytes:
    signed = _DOMAIN_SEPARATION + bytes([key.id]) + recipient_id.bytes
    return hmac.new(key.secret, signed, hashlib.sha256).digest()[:_MAC_BYTES]


def token(key: SigningKey, recipient_id: uuid.UUID) -> str:
    raw = bytes([key.id]) + recipient_id.bytes + _mac(key, recipient_id)
    return base64.b32encode(raw).decode("ascii").lower()


def return_path(key: SigningKey, recipient_id: uuid.UUID, domain: str) -> str:
    """The envelope sender of mail to one recipient, at a return-path domain."""
    return f"{PREFIX}{token(key, recipient_id)}@{domain}"


def read_token(local_part: str, keys: Mapping[int, SigningKey]) -> uuid.UUID | None:
    """The recipient id a local part's token names, None when it is no token, or not one of
    `keys` (the keys that still verify), or its MAC is wrong."""
    if not local_part[: len(PREFIX)].lower() == PREFIX:
        return None
    text = local_part[len(PREFIX) :]
    if len(text) != TOKEN_LENGTH:
        return None
    try:
        raw = base64.b32decode(text.upper())
    except ValueError:
        return None
    key = keys.get(raw[0])
    if key is None:
        return None
    recipient_id = uuid.UUID(bytes=raw[1:17])
    if not hmac.compare_digest(raw[17:], _mac(key, recipient_id)):
        return None
    return recipient_id
