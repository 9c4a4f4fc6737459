"""The self-signed fallback certificate: valid at most 397 days, made again near its end."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pigeon_mta.submission.tls import ensure_self_signed
from tests.integration.submission_helpers import HOSTNAME, make_settings


def certificate(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_generated_certificate_is_valid_for_at_most_397_days(tmp_path: Path) -> None:
    cert = certificate(ensure_self_signed(make_settings(tmp_path, "postgresql://unused", None)))
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime <= dt.timedelta(days=397)
    assert cert.not_valid_before_utc <= dt.datetime.now(dt.UTC) < cert.not_valid_after_utc


def test_a_certificate_about_to_expire_is_made_again(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, "postgresql://unused", None)
    path = tmp_path / "tls" / "selfsigned.pem"
    path.parent.mkdir()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOSTNAME)])
    now = dt.datetime.now(dt.UTC)
    old = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=380))
        .not_valid_after(now + dt.timedelta(days=5))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOSTNAME)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        + old.public_bytes(serialization.Encoding.PEM)
    )
    renewed = certificate(ensure_self_signed(settings))
    assert renewed.serial_number != old.serial_number
    assert renewed.not_valid_after_utc > now + dt.timedelta(days=300)
