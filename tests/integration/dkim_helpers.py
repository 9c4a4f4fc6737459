"""Test data for DKIM: an org's sender domain (inserted directly: `domain add` belongs to another
module), keys in the store, and deliveries to sign."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg

from pigeon_mta import dkim
from pigeon_mta.ids import new_id
from pigeon_mta.model import ClaimedRecipient, Delivery
from pigeon_mta.store import dkim_keys as store_dkim_keys

Db = asyncpg.Pool | asyncpg.Connection


async def add_sender_domain(db: Db, org_name: str, domain: str) -> store_dkim_keys.SenderDomain:
    """Org `org_name` (created if missing) may send as `domain`."""
    await db.execute(
        "INSERT INTO org (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        new_id(),
        org_name,
    )
    await db.execute(
        """INSERT INTO sender_domain (id, org_id, domain)
           SELECT $1, id, $3 FROM org WHERE name = $2""",
        new_id(),
        org_name,
        domain,
    )
    found = await store_dkim_keys.find_sender_domain(db, domain)
    assert found is not None
    return found


async def add_key(
    db: Db,
    domain: store_dkim_keys.SenderDomain,
    selector: str,
    algorithm: dkim.Algorithm = "rsa",
    bits: int | None = None,
) -> tuple[store_dkim_keys.DkimKey, str]:
    """A new key for `domain`, as `dkim keygen` stores it; returns it and its TXT record value."""
    generated = dkim.generate_key(algorithm, bits)
    key = await store_dkim_keys.add_key(
        db,
        domain,
        selector=selector,
        algorithm=generated.algorithm,
        key_bits=generated.bits,
        private_key=generated.private_pem,
        public_key=generated.public_key,
    )
    return key, dkim.txt_record_value(generated.algorithm, generated.public_key)


def delivery(org_id: uuid.UUID, body: bytes, recipient: str = "bob@example.net") -> Delivery:
    return Delivery(
        queue_id=new_id(),
        org_id=org_id,
        sender="alice@example.com",
        domain=recipient.rpartition("@")[2],
        header_message_id=None,
        received_at=datetime.now(UTC),
        body=body,
        recipients=(ClaimedRecipient(new_id(), recipient, 1, datetime.now(UTC)),),
    )
