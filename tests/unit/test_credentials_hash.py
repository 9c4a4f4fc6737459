"""Password hashes: scrypt, salted, self-describing, compared in constant time."""

from __future__ import annotations

from pigeon_mta.store.credentials import (
    DUMMY_HASH,
    generate_password,
    hash_password,
    verify_password,
)


def test_hash_and_verify() -> None:
    encoded = hash_password("s3cret")
    assert encoded.startswith("scrypt$16384$8$1$")
    assert "s3cret" not in encoded
    assert verify_password("s3cret", encoded)
    assert not verify_password("s3cret ", encoded)
    assert hash_password("s3cret") != encoded  # salted


def test_malformed_hashes_match_nothing() -> None:
    for encoded in [
        "",
        "plain",
        "scrypt$x$8$1$AA==$AA==",
        "bcrypt$1$2$3$4$5",
        "scrypt$16384$8$1$!!$??",
    ]:
        assert not verify_password("anything", encoded)
    assert not verify_password("", DUMMY_HASH)


def test_generated_passwords_are_long_and_different() -> None:
    passwords = {generate_password() for _ in range(20)}
    assert len(passwords) == 20
    assert all(len(p) >= 24 for p in passwords)
