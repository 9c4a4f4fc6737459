"""Listener certificates: reloaded on request (SIGHUP), self-signed when none is configured.

client (verifying with the test CA) ──STARTTLS / implicit TLS──► listeners
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import shutil
import smtplib
import socket
import ssl
from pathlib import Path

import asyncpg
import pytest
import trustme

from pigeon_mta.config_review import config_warnings
from pigeon_mta.submission.tls import ensure_self_signed
from tests.integration.submission_helpers import (
    issue_cert,
    make_settings,
    make_tls,
    running_service,
    smtp_client,
)


def served_certificate(port: int, *, implicit: bool) -> bytes:
    context = ssl._create_unverified_context()
    if implicit:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            with context.wrap_socket(s) as tls:
                der = tls.getpeercert(binary_form=True)
    else:
        with smtp_client(port) as client:
            client.starttls(context=context)
            der = client.sock.getpeercert(binary_form=True)  # type: ignore[union-attr]
    assert der is not None
    return der


async def test_reload_serves_the_new_certificate(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool
) -> None:
    tls = make_tls(tmp_path)
    settings = make_settings(tmp_path, db_url, tls, modes=("submission", "submissions"))
    async with running_service(settings, pool) as running:
        ports = {"submission": False, "submissions": True}
        before = {
            name: await asyncio.to_thread(served_certificate, running.port(name), implicit=implicit)
            for name, implicit in ports.items()
        }
        # Renewal: new files at the same paths (as certbot does), then a reload.
        renewed = issue_cert(trustme.CA(), tmp_path, "renewed")
        shutil.copy(renewed.cert_file, tls.cert_file)
        shutil.copy(renewed.key_file, tls.key_file)
        running.service.reload()
        after = {
            name: await asyncio.to_thread(served_certificate, running.port(name), implicit=implicit)
            for name, implicit in ports.items()
        }
        # A broken file is refused and the current certificate stays.
        tls.cert_file.write_text("not a certificate")
        running.service.reload()
        kept = await asyncio.to_thread(
            served_certificate, running.port("submissions"), implicit=True
        )

        def verified_with_new_ca() -> int:
            with smtplib.SMTP_SSL(
                "127.0.0.1",
                running.port("submissions"),
                context=renewed.client_context(),
                timeout=30,
            ) as client:
                return client.noop()[0]

        assert await asyncio.to_thread(verified_with_new_ca) == 250
    expected = ssl.PEM_cert_to_DER_cert(
        renewed.cert_file.read_text().split("\n-----BEGIN")[0] + "\n"
    )
    for name in ports:
        assert before[name] != after[name]
        assert after[name] == expected
    assert kept == expected


async def test_listener_without_certificate_gets_a_self_signed_one(
    tmp_path: Path, db_url: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    settings = make_settings(tmp_path, db_url, None, modes=("submission", "submissions"))
    async with running_service(settings, pool) as running:
        der = await asyncio.to_thread(
            served_certificate, running.port("submissions"), implicit=True
        )
        der_starttls = await asyncio.to_thread(
            served_certificate, running.port("submission"), implicit=False
        )
    path = tmp_path / "tls" / "selfsigned.pem"
    assert path.stat().st_mode & 0o777 == 0o600
    assert der == der_starttls
    pem = path.read_text()
    assert ssl.PEM_cert_to_DER_cert(pem[pem.index("-----BEGIN CERTIFICATE") :]) == der
    assert "generated a self-signed TLS certificate" in caplog.text
    # The listeners without a certificate are named once, by serve at start (config_review).
    (warning,) = [w for w in config_warnings(settings) if "self-signed" in w]
    assert warning.startswith("listeners submission, submissions have no tls_cert/tls_key")


def test_self_signed_certificate_is_made_once_when_processes_start_together(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path, "postgresql://unused", None)
    with concurrent.futures.ProcessPoolExecutor(4) as workers:
        paths = list(workers.map(ensure_self_signed, [settings] * 8))
    assert set(paths) == {tmp_path / "tls" / "selfsigned.pem"}
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(paths[0])  # key and certificate match
    # It is kept while still good for the hostname.
    first = paths[0].read_bytes()
    assert ensure_self_signed(settings).read_bytes() == first
    # A new hostname gets a new certificate.
    renamed = dataclasses.replace(
        settings, server=dataclasses.replace(settings.server, hostname="other.test")
    )
    assert ensure_self_signed(renamed).read_bytes() != first
