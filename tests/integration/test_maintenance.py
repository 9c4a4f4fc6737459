"""The supervisor's queue maintenance against a real PostgreSQL: what it owes the delivery log."""

from __future__ import annotations

import dataclasses
import time
import uuid

import asyncpg

from pigeon_mta import metrics
from pigeon_mta.config import (
    BounceSettings,
    DeliverySettings,
    Duration,
    RetentionSettings,
    Settings,
)
from pigeon_mta.ids import id_floor
from pigeon_mta.maintenance import Maintenance
from pigeon_mta.store.upkeep import ExpiredRecipient
from tests.integration.queue_helpers import bulk_queue


async def test_expiries_whose_log_records_could_not_be_read_are_logged_next_round(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A database blip while the Expiration records are read loses none of them: the next
    round hands over those and the new ones together."""
    settings = dataclasses.replace(
        Settings(), delivery=dataclasses.replace(DeliverySettings(), max_age=Duration(3600))
    )
    handed: list[list[ExpiredRecipient]] = []

    async def flaky_log(expired: list[ExpiredRecipient]) -> None:
        handed.append(list(expired))
        if len(handed) == 1:
            raise asyncpg.CannotConnectNowError("the database is starting up")

    maintenance = Maintenance(settings, pool, on_expired=flaky_log)
    await bulk_queue(pool, org_id, messages=3, age=7200, domain="old.example")
    try:
        await maintenance.sweep_once()
    except asyncpg.CannotConnectNowError:
        pass  # run() logs it and goes on; the records are kept
    await bulk_queue(pool, org_id, messages=2, age=7200, domain="older.example")
    await maintenance.sweep_once()
    await maintenance.sweep_once()  # nothing new, nothing owed: no call

    assert [len(batch) for batch in handed] == [3, 5]
    assert {e.recipient_id for e in handed[0]} <= {e.recipient_id for e in handed[1]}
    assert await pool.fetchval("SELECT count(*) FROM recipient WHERE status = 'expired'") == 5


async def test_delay_warnings_are_sent_only_when_configured(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """bounces.delay_warning_after = 0 (the default) sends none; set, the maintenance round
    queues them for recipients deferred longer than it."""
    await bulk_queue(pool, org_id, messages=2, recipients_per_message=2, age=7200, due_in=600)
    await pool.execute("UPDATE recipient SET attempts = 1")  # deferred after one try

    await Maintenance(Settings(), pool).sweep_once()
    assert await warnings_queued(pool) == 0

    settings = dataclasses.replace(
        Settings(),
        bounces=dataclasses.replace(BounceSettings(), delay_warning_after=Duration(3600)),
    )
    await Maintenance(settings, pool).sweep_once()
    assert await warnings_queued(pool) == 2  # one per message, to sender@example.com
    await Maintenance(settings, pool).sweep_once()
    assert await warnings_queued(pool) == 2


async def warnings_queued(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            """SELECT count(*) FROM message m JOIN recipient r ON r.message_id = m.id
               WHERE m.sender = '' AND r.address = 'sender@example.com'
                 AND position('Action: delayed'::bytea IN m.body) > 0"""
        )
    )


async def test_a_code_stored_with_a_unicode_digit_still_gets_its_delay_warning(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """A 450 reply whose enhanced code has an ARABIC-INDIC DIGIT ONE, stored as a version that
    read codes with \\d stored it: the warning goes out with the generic status, every round."""
    await bulk_queue(pool, org_id, messages=2, age=7200, due_in=600)
    await pool.execute(
        "UPDATE recipient SET attempts = 1, last_code = 450, last_enhanced_code = $1, "
        "last_response = $2",
        "4.\u0661.1",
        "try later \u0661",
    )
    settings = dataclasses.replace(
        Settings(),
        bounces=dataclasses.replace(BounceSettings(), delay_warning_after=Duration(3600)),
    )
    failed = metrics.MAINTENANCE_FAILURES.labels(task="warn_delayed")._value.get()  # type: ignore[attr-defined]
    await Maintenance(settings, pool).sweep_once()
    assert await warnings_queued(pool) == 2
    body = bytes(await pool.fetchval("SELECT body FROM message WHERE sender = '' LIMIT 1"))
    assert b"Status: 4.0.0" in body
    assert b"Diagnostic-Code: smtp; 450 4.\\u0661.1 try later \\u0661\r\n" in body
    assert metrics.MAINTENANCE_FAILURES.labels(task="warn_delayed")._value.get() == failed  # type: ignore[attr-defined]


async def test_a_task_that_fails_does_not_stop_the_rest_of_the_round(
    pool: asyncpg.Pool, org_id: uuid.UUID
) -> None:
    """Delay warnings that cannot be queued (a trigger refuses DSNs) fail their task; retention,
    the next task, still deletes the finished message that is past it."""
    await bulk_queue(pool, org_id, messages=1, age=7200, due_in=600)
    await pool.execute("UPDATE recipient SET attempts = 1")
    old = id_floor(time.time() - 7200)
    await pool.execute(
        """INSERT INTO message (id, org_id, sender, size, body, listener, received_at)
           VALUES ($1, $2, 'old@example.com', 10, 'x', 'test', now() - interval '2 hours');
           INSERT INTO recipient (id, message_id, org_id, address, domain, status, created_at,
                                  next_attempt_at)
           VALUES (gen_random_uuid(), $1, $2, 'done@example.net', 'example.net', 'delivered',
                   now() - interval '2 hours', now())""".replace("$1", f"'{old}'").replace(
            "$2", f"'{org_id}'"
        )
    )
    await pool.execute(
        """CREATE FUNCTION refuse_dsn() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN IF NEW.sender = '' THEN RAISE EXCEPTION 'refused (test)'; END IF;
           RETURN NEW; END $$;
           CREATE TRIGGER refuse_dsn BEFORE INSERT ON message
           FOR EACH ROW EXECUTE FUNCTION refuse_dsn()"""
    )
    settings = dataclasses.replace(
        Settings(),
        bounces=dataclasses.replace(BounceSettings(), delay_warning_after=Duration(3600)),
        retention=RetentionSettings(messages=Duration(3600)),
    )
    failed = metrics.MAINTENANCE_FAILURES.labels(task="warn_delayed")._value.get()  # type: ignore[attr-defined]
    await Maintenance(settings, pool).sweep_once()
    assert metrics.MAINTENANCE_FAILURES.labels(task="warn_delayed")._value.get() == failed + 1  # type: ignore[attr-defined]
    assert await pool.fetchval("SELECT count(*) FROM message WHERE id = $1", old) == 0
    # The warning was not marked as sent: it is owed at a later round.
    assert (
        await pool.fetchval("SELECT count(*) FROM recipient WHERE delay_warned_at IS NOT NULL") == 0
    )


async def test_suspensions_that_ended_an_hour_ago_are_deleted(pool: asyncpg.Pool) -> None:
    """Reply holds come and go, one row per org and site: the round deletes those that ended
    more than an hour ago, and keeps those in force, recently ended or until resumed."""
    await pool.execute(
        """INSERT INTO suspension (key, until, reason, kind) VALUES
               ('destination:site:a|org:1', now() - interval '2 hours', 'old hold', 'reply'),
               ('destination:site:a|org:2', now() - interval '10 minutes', 'recent', 'reply'),
               ('destination:site:a|org:3', now() + interval '10 minutes', 'in force', 'reply'),
               ('org:4', NULL, 'abuse review', 'operator')"""
    )
    await Maintenance(Settings(), pool).sweep_once()
    kept = await pool.fetch("SELECT reason FROM suspension ORDER BY reason")
    assert [r["reason"] for r in kept] == ["abuse review", "in force", "recent"]
