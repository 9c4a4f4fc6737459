"""An outbox table in the application's database: its DDL (`outbox install`) and every statement
pigeon-mta runs there. The columns are a contract with the application (README "An outbox in the
application's database"): it writes `idempotency_key` and either `message` (the HTTP API's JSON
form) or `raw` with `mail_from` and `rcpt_to`; pigeon-mta writes `queue_id`, `relayed_at` and
`error`, and deletes relayed rows after the outbox's retention.

Rows waiting are those with neither `relayed_at` nor `error`; partial indexes keep their claim
and the backlog's counts from reading the relayed ones. The trigger NOTIFYs the channel `CHANNEL` once per inserting
statement (with the table's name), in the application's transaction: the relay hears of a row
when it commits, never before.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

CHANNEL = "pigeon_outbox"


def ddl(table: str) -> str:
    """The statements that create the table, its indexes and its trigger (idempotent)."""
    base = table.rpartition(".")[2]
    return f"""CREATE TABLE IF NOT EXISTS {table} (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key  text NOT NULL UNIQUE,
    created_at       timestamptz NOT NULL DEFAULT now(),
    message          jsonb,
    raw              bytea,
    mail_from        text,
    rcpt_to          text[],
    queue_id         uuid,
    relayed_at       timestamptz,
    error            text,
    CONSTRAINT {base}_one_form CHECK ((message IS NULL) <> (raw IS NULL)),
    CONSTRAINT {base}_raw_envelope CHECK (raw IS NULL OR (mail_from IS NOT NULL AND rcpt_to IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS {base}_waiting ON {table} (id)
    WHERE relayed_at IS NULL AND error IS NULL;
CREATE INDEX IF NOT EXISTS {base}_relayed ON {table} (relayed_at) WHERE relayed_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {base}_refused ON {table} (id)
    WHERE error IS NOT NULL AND relayed_at IS NULL;
CREATE INDEX IF NOT EXISTS {base}_order ON {table} ((message->>'order_key'), id)
    WHERE relayed_at IS NULL AND error IS NULL;
CREATE OR REPLACE FUNCTION {table}_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', TG_TABLE_NAME);
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS {base}_notify ON {table};
CREATE TRIGGER {base}_notify AFTER INSERT ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {table}_notify();
"""


@dataclass(frozen=True)
class Row:
    """A waiting row, as the application wrote it."""

    id: int
    key: str
    created_at: datetime
    message: str | None  # JSON text
    raw: bytes | None
    mail_from: str | None
    rcpt_to: tuple[str, ...] | None


@dataclass(frozen=True)
class Backlog:
    waiting: int
    oldest_age: float | None  # seconds the oldest waiting row has waited, by the database's clock
    refused: int
    last_relayed: datetime | None


class Table:
    """The statements of one outbox table (its name checked by config_outbox.py)."""

    def __init__(self, table: str) -> None:
        self.name = table
        # A row with an ordering key waits while an earlier row of its key waits too (another
        # relay may hold it): the key's rows are queued in the order they were written.
        self._claim = f"""
            SELECT id, idempotency_key, created_at, message::text AS message, raw, mail_from,
                   rcpt_to
            FROM {table} t WHERE relayed_at IS NULL AND error IS NULL
              AND (message->>'order_key' IS NULL OR NOT EXISTS (
                  SELECT 1 FROM {table} e
                  WHERE e.message->>'order_key' = t.message->>'order_key' AND e.id < t.id
                    AND e.relayed_at IS NULL AND e.error IS NULL))
            ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"""
        self._relayed = f"""
            UPDATE {table} t SET queue_id = u.queue_id, relayed_at = now(), error = NULL
            FROM unnest($1::bigint[], $2::uuid[]) AS u (id, queue_id) WHERE t.id = u.id"""
        self._refused = f"""
            UPDATE {table} t SET error = u.error
            FROM unnest($1::bigint[], $2::text[]) AS u (id, error) WHERE t.id = u.id"""
        self._prune = f"""
            DELETE FROM {table} WHERE id = ANY (ARRAY(
                SELECT id FROM {table}
                WHERE relayed_at IS NOT NULL AND relayed_at < now() - make_interval(secs => $1)
                LIMIT $2))"""
        # Each part through its partial index: the relayed rows, the most, are never read.
        self._backlog = f"""
            SELECT w.waiting, extract(epoch FROM now() - w.oldest)::float8 AS oldest_age,
                   (SELECT count(*) FROM {table}
                    WHERE error IS NOT NULL AND relayed_at IS NULL) AS refused,
                   (SELECT max(relayed_at) FROM {table}
                    WHERE relayed_at IS NOT NULL) AS last_relayed
            FROM (SELECT count(*) AS waiting, min(created_at) AS oldest FROM {table}
                  WHERE relayed_at IS NULL AND error IS NULL) w"""

    async def claim(self, conn: asyncpg.Connection, batch: int) -> list[Row]:
        """Up to `batch` waiting rows, oldest first, locked until the caller's transaction ends;
        rows another relay holds are passed over."""
        rows = await conn.fetch(self._claim, batch)
        return [
            Row(
                r["id"],
                r["idempotency_key"],
                r["created_at"],
                r["message"],
                bytes(r["raw"]) if r["raw"] is not None else None,
                r["mail_from"],
                tuple(r["rcpt_to"]) if r["rcpt_to"] is not None else None,
            )
            for r in rows
        ]

    async def write_back(
        self,
        conn: asyncpg.Connection,
        relayed: Sequence[tuple[int, uuid.UUID]],
        refused: Sequence[tuple[int, str]],
    ) -> None:
        if relayed:
            await conn.execute(self._relayed, [i for i, _ in relayed], [q for _, q in relayed])
        if refused:
            await conn.execute(self._refused, [i for i, _ in refused], [e for _, e in refused])

    async def prune(self, conn: asyncpg.Connection, retention: float, limit: int = 5000) -> int:
        result = await conn.execute(self._prune, retention, limit)
        return int(result.split()[-1])

    async def backlog(self, conn: asyncpg.Connection) -> Backlog:
        row = await conn.fetchrow(self._backlog)
        assert row is not None
        return Backlog(row["waiting"], row["oldest_age"], row["refused"], row["last_relayed"])
