"""The HTTP API over HTTPS (`[api] tls_cert` and `tls_key`), and a certificate that cannot be
loaded refused at start with a sentence naming the keys.

aiohttp client ──HTTPS (trustme CA)──► ApiService 127.0.0.1:<free port> ── PostgreSQL
"""

from __future__ import annotations

import json
import ssl
import uuid
from pathlib import Path

import aiohttp
import asyncpg
import pytest
import trustme

from pigeon_mta.api.server import ApiService
from pigeon_mta.config import ApiSettings, HostPort, Settings
from pigeon_mta.intake.accept import Intake
from tests.conftest import free_port
from tests.integration.api_helpers import running_api


async def test_a_send_over_https_records_the_tls_session(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "api.pem", tmp_path / "api.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    settings = Settings(api=ApiSettings(tls_cert=str(cert), tls_key=str(key)))
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    async with running_api(pool, settings) as api:
        assert api.url.startswith("https://")
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                api.url + "/v1/messages",
                json={"from": "shop@acme.example", "to": "ann@dest.example", "text": "hi"},
                headers={"Authorization": f"Bearer {api.key}"},
                ssl=client_context,
            ) as answer,
        ):
            assert answer.status == 202, await answer.text()
            queue_id = uuid.UUID(json.loads(await answer.read())["queue_id"])
    row = await pool.fetchrow("SELECT tls_version, tls_cipher FROM message WHERE id = $1", queue_id)
    assert row["tls_version"].startswith("TLSv1.") and row["tls_cipher"]


async def test_a_certificate_that_cannot_be_loaded_stops_the_start(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.pem"
    settings = Settings(
        api=ApiSettings(
            listen=HostPort("127.0.0.1", free_port()), tls_cert=str(missing), tls_key=str(missing)
        )
    )
    service = ApiService(settings, pool, Intake.of(settings, pool))
    with pytest.raises(RuntimeError, match=r"cannot load 'api.tls_cert' .* with 'api.tls_key'"):
        await service.start()
