"""VERP tokens: a token names its recipient only with the key that signed it, whatever the case
of the local part; anything else is no token."""

from __future__ import annotations

import uuid

from pigeon_mta.feedback.tokens import PREFIX, TOKEN_LENGTH, SigningKey, read_token, return_path

KEY = SigningKey(7, bytes(range(32)))
OTHER = SigningKey(7, bytes(range(1, 33)))


def local_part(recipient: uuid.UUID, key: SigningKey = KEY) -> str:
    return return_path(key, recipient, "bounces.example.com").rpartition("@")[0]


def test_a_token_names_its_recipient_and_survives_a_change_of_case() -> None:
    recipient = uuid.uuid4()
    local = local_part(recipient)
    assert local.startswith(PREFIX) and len(local) == len(PREFIX) + TOKEN_LENGTH
    assert len(local) <= 64  # RFC 5321 4.5.3.1.1
    assert read_token(local, {KEY.id: KEY}) == recipient
    assert read_token(local.upper(), {KEY.id: KEY}) == recipient


def test_a_token_under_another_or_a_missing_key_names_nobody() -> None:
    recipient = uuid.uuid4()
    assert read_token(local_part(recipient, OTHER), {KEY.id: KEY}) is None
    assert read_token(local_part(recipient), {}) is None
    assert read_token(local_part(recipient), {8: SigningKey(8, KEY.secret)}) is None


def test_a_changed_recipient_or_mac_is_refused() -> None:
    local = local_part(uuid.uuid4())
    keys = {KEY.id: KEY}
    for i in range(len(PREFIX), len(local)):
        flipped = local[:i] + ("a" if local[i] != "a" else "b") + local[i + 1 :]
        assert read_token(flipped, keys) is None, i


def test_what_is_no_token_is_none() -> None:
    keys = {KEY.id: KEY}
    for text in (
        "",
        "b-",
        "bob",
        "b-" + "a" * 39,
        "b-" + "a" * 41,
        "b-" + "1" * 40,
        "x-" + "a" * 40,
    ):
        assert read_token(text, keys) is None, text
