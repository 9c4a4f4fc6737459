"""Real submission listeners for tests: settings, a TLS certificate from a test CA, users, clients.

Topology: test client (127.0.0.1 trusted, 127.0.0.2 untrusted) ──SMTP──► SubmissionService (this
event loop, port 0) ──► PostgreSQL (a fresh database per test).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import smtplib
import ssl
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import trustme

from pigeon_mta.config import (
    DatabaseSettings,
    HostPort,
    LimitsSettings,
    ListenerSettings,
    Network,
    RelaySettings,
    ServerSettings,
    Settings,
)
from pigeon_mta.store import credentials as store_credentials
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.submission.service import SubmissionService

HOSTNAME = "mta.test"
TRUSTED_CLIENT = "127.0.0.1"
UNTRUSTED_CLIENT = "127.0.0.2"
PASSWORD = "correct horse battery staple"


@dataclass
class ServerTLS:
    ca: trustme.CA
    cert_file: Path
    key_file: Path

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


def make_tls(directory: Path, name: str = "server") -> ServerTLS:
    ca = trustme.CA()
    return issue_cert(ca, directory, name)


def issue_cert(ca: trustme.CA, directory: Path, name: str) -> ServerTLS:
    cert = ca.issue_cert("localhost", "127.0.0.1", HOSTNAME)
    cert_file = directory / f"{name}-chain.pem"
    key_file = directory / f"{name}-key.pem"
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_file.write_bytes(cert.private_key_pem.bytes())
    return ServerTLS(ca, cert_file, key_file)


def make_settings(
    directory: Path,
    db_url: str,
    tls: ServerTLS | None,
    *,
    modes: tuple[str, ...] = ("relay", "submission", "submissions"),
    trusted: tuple[str, ...] = ("127.0.0.1/32",),
    sender_policy: str = "strict",
    plaintext_auth: bool = False,
    **limits: Any,
) -> Settings:
    listeners = tuple(
        ListenerSettings(
            name=mode,
            address=HostPort("127.0.0.1", 0),
            mode=mode,  # type: ignore[arg-type]
            tls_cert=str(tls.cert_file) if tls else "",
            tls_key=str(tls.key_file) if tls else "",
            allow_plaintext_auth=plaintext_auth,
        )
        for mode in modes
    )
    return Settings(
        server=ServerSettings(hostname=HOSTNAME, data_dir=str(directory), node_name="test"),
        database=DatabaseSettings(url=db_url),
        listener=listeners,
        relay=RelaySettings(
            trusted_networks=tuple(Network.parse(n) for n in trusted),
            sender_policy=sender_policy,  # type: ignore[arg-type]
        ),
        limits=dataclasses.replace(LimitsSettings(), **limits),
    )


@dataclass
class Running:
    service: SubmissionService
    pool: asyncpg.Pool
    settings: Settings

    def port(self, listener: str) -> int:
        return self.service.bound[listener][1]


@contextlib.asynccontextmanager
async def running_service(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[Running]:
    service = SubmissionService(settings, pool)
    await service.start()
    try:
        yield Running(service, pool, settings)
    finally:
        await service.stop(asyncio.get_running_loop().time() + 5)


@dataclass(frozen=True)
class User:
    username: str
    password: str
    org_id: uuid.UUID
    credential_id: uuid.UUID


async def add_user(
    pool: asyncpg.Pool,
    username: str = "alice",
    *,
    org: str = "acme",
    domains: tuple[str, ...] = ("acme.example",),
    password: str = PASSWORD,
) -> User:
    org_id = await store_orgs.ensure_org(pool, org)
    for domain in domains:
        await store_domains.add_sender_domain(pool, org_id, domain)
    credential = await store_credentials.add_credential(
        pool, org_id, username, store_credentials.hash_password(password)
    )
    return User(username, password, org_id, credential.id)


def message(sender: str, recipient: str, subject: str = "test", body: str = "Hello.\r\n") -> bytes:
    return f"From: {sender}\r\nTo: {recipient}\r\nSubject: {subject}\r\n\r\n{body}".encode()


def smtp_client(port: int, source: str = TRUSTED_CLIENT, timeout: float = 30) -> smtplib.SMTP:
    """A blocking client from `source` (call it in a thread: the server runs on this loop)."""
    return smtplib.SMTP("127.0.0.1", port, timeout=timeout, source_address=(source, 0))


def queue_id_of(reply: bytes | str) -> uuid.UUID:
    text = reply.decode() if isinstance(reply, bytes) else reply
    assert "queued as " in text, text
    return uuid.UUID(text.rsplit("queued as ", 1)[1].strip())


async def message_rows(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch(
        """SELECT m.*, array_agg(r.address ORDER BY r.address) AS recipients
           FROM message m LEFT JOIN recipient r ON r.message_id = m.id
           GROUP BY m.id ORDER BY m.received_at"""
    )


async def counts(pool: asyncpg.Pool) -> tuple[int, int]:
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM message) AS m, (SELECT count(*) FROM recipient) AS r"
    )
    assert row is not None
    return row["m"], row["r"]


async def wait_until(condition: Callable[[], bool], timeout: float = 30) -> None:
    """Wait for `condition` (a generous bound: this is not a timing assertion)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
