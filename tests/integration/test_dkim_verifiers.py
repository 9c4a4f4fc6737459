"""Our signatures pass independent verifiers that fetch the keys over DNS, and tampering fails them.

dkim.sign ──► message ──► opendkim-testmsg / Mail::DKIM / dkimpy ──► DkimZone (127.0.0.x:53)
                                                                     TXT = `dkim keygen` record
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pigeon_mta import dkim
from tests.peers.dkim_samples import SAMPLES
from tests.peers.dkim_verify import DkimZone, dkimpy_verify, mail_dkim_verify, opendkim_verify

T = 1_764_428_400


_KEYS: list[tuple[str, dkim.Algorithm, int | None]] = [
    ("rsa", "rsa", 2048),
    ("rsa4096", "rsa", 4096),
    ("ed", "ed25519", None),
]
_MISMATCHED: list[tuple[str, dkim.Algorithm]] = [("wrong-rsa", "rsa"), ("wrong-ed", "ed25519")]


@pytest.fixture(scope="module")
def published() -> Iterator[tuple[DkimZone, dict[str, dkim.SigningKey]]]:
    """RSA-2048, RSA-4096 (a record over 512 bytes: truncated over UDP, fetched over TCP),
    Ed25519, and keys whose published record belongs to another key."""
    keys: dict[str, dkim.SigningKey] = {}
    with DkimZone() as zone:
        for selector, algorithm, bits in _KEYS:
            generated = dkim.generate_key(algorithm, bits)
            keys[selector] = dkim.load_signing_key(
                "example.com", selector, generated.algorithm, generated.private_pem
            )
            zone.add(
                dkim.record_name(selector, "example.com"),
                dkim.txt_record_value(generated.algorithm, generated.public_key),
            )
        for selector, algorithm in _MISMATCHED:
            signing, other = dkim.generate_key(algorithm), dkim.generate_key(algorithm)
            keys[selector] = dkim.load_signing_key(
                "example.com", selector, signing.algorithm, signing.private_pem
            )
            zone.add(
                dkim.record_name(selector, "example.com"),
                dkim.txt_record_value(other.algorithm, other.public_key),
            )
        yield zone, keys


@pytest.fixture
def zone(published: tuple[DkimZone, dict[str, dkim.SigningKey]]) -> DkimZone:
    return published[0]


@pytest.fixture
def keys(published: tuple[DkimZone, dict[str, dkim.SigningKey]]) -> dict[str, dkim.SigningKey]:
    return published[1]


def _signed(sample: str, *selectors: str, keys: dict[str, dkim.SigningKey]) -> bytes:
    message = SAMPLES[sample]
    return dkim.sign(message, [keys[s] for s in selectors], timestamp=T) + message


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_rsa_passes_opendkim_and_mail_dkim(
    sample: str, zone: DkimZone, keys: dict[str, dkim.SigningKey]
) -> None:
    signed = _signed(sample, "rsa", keys=keys)
    result = opendkim_verify(signed, zone)
    assert result.ok, result.output
    assert [s.result for s in mail_dkim_verify(signed, zone)] == ["pass"]


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_ed25519_passes_opendkim(
    sample: str, zone: DkimZone, keys: dict[str, dkim.SigningKey]
) -> None:
    signed = _signed(sample, "ed", keys=keys)
    result = opendkim_verify(signed, zone)
    assert result.ok, result.output
    assert dkimpy_verify(signed, zone) == [True]


def test_rsa_4096_record_is_fetched_and_verified(
    zone: DkimZone, keys: dict[str, dkim.SigningKey]
) -> None:
    signed = _signed("plain", "rsa4096", keys=keys)
    assert opendkim_verify(signed, zone).ok
    assert [s.result for s in mail_dkim_verify(signed, zone)] == ["pass"]


def test_both_signatures_on_one_message(zone: DkimZone, keys: dict[str, dkim.SigningKey]) -> None:
    signed = _signed("folded_long_headers", "rsa", "ed", keys=keys)
    assert dkimpy_verify(signed, zone) == [True, True]
    assert opendkim_verify(signed, zone).ok
    # Bookworm's Mail::DKIM passes the RSA signature and cannot check Ed25519.
    results = mail_dkim_verify(signed, zone)
    assert (results[0].result, results[0].algorithm) == ("pass", "rsa-sha256")
    assert results[1].algorithm == "ed25519-sha256" and results[1].result != "pass"


@pytest.mark.parametrize("selector", ["rsa", "ed"])
@pytest.mark.parametrize(
    ("sample", "old", "new"),
    [
        ("eight_bit", b"zweite Zeile", b"dritte Zeile"),
        ("no_final_crlf", b"last line without CRLF", b"last line without CRLF!"),
        ("folded_long_headers", b"\tand a third line", b"\tand a 3rd line"),
        ("plain", b"To: bob@example.net", b"To: eve@example.net"),
    ],
)
def test_tampering_fails_independent_verifiers(
    selector: str,
    sample: str,
    old: bytes,
    new: bytes,
    zone: DkimZone,
    keys: dict[str, dkim.SigningKey],
) -> None:
    signed = _signed(sample, selector, keys=keys)
    tampered = signed.replace(old, new)
    assert tampered != signed
    result = opendkim_verify(tampered, zone)
    assert not result.ok and "Bad signature" in result.output
    if selector == "rsa":
        assert [s.result for s in mail_dkim_verify(tampered, zone)] == ["fail"]


@pytest.mark.parametrize("selector", ["wrong-rsa", "wrong-ed"])
def test_a_record_of_another_key_fails(
    selector: str, zone: DkimZone, keys: dict[str, dkim.SigningKey]
) -> None:
    signed = _signed("plain", selector, keys=keys)
    assert not opendkim_verify(signed, zone).ok
    assert dkimpy_verify(signed, zone) == [False]
