"""The sendmail door's message through the one intake (commands/sendmail.py reads the command
line): the envelope, the intake's prepare and commit on a pool of its own, and a NOTIFY so that
a running serve delivers it at once. Every failure is one line on stderr and a sysexits code."""

from __future__ import annotations

import asyncio
import logging
import sys

import asyncpg

from pigeon_mta.commands.sendmail_message import (
    EX_CONFIG,
    EX_DATAERR,
    EX_NOUSER,
    EX_OK,
    EX_TEMPFAIL,
    EX_USAGE,
    LISTENER,
    BadAddress,
    Options,
    addresses_of,
    header_recipients,
    qualified,
    read_message,
    with_from,
)
from pigeon_mta.config_loader import ConfigError, load_settings
from pigeon_mta.intake.accept import Intake
from pigeon_mta.intake.addresses import AddressProblem, parse_mailbox
from pigeon_mta.intake.refusal import Reason, Refusal
from pigeon_mta.intake.submission import Door, Submission, Submitter
from pigeon_mta.redaction import redact
from pigeon_mta.store import connect as store_connect
from pigeon_mta.store.connect import DB_ERRORS, DatabaseUnavailable
from pigeon_mta.store.queue import NOTIFY_CHANNEL

log = logging.getLogger("pigeon_mta.sendmail")


def _fail(code: int, text: str) -> int:
    print(f"sendmail: {text}", file=sys.stderr)
    return code


async def queue_message(options: Options, data: bytes, *, user: str) -> int:
    try:
        settings = load_settings(options.config)
    except ConfigError as exc:
        return _fail(EX_CONFIG, f"config error: {exc}")
    message = read_message(data, dot_ends=options.dot_ends)
    domain = settings.server.hostname
    try:
        recipients = addresses_of(options.recipients, domain)
    except BadAddress as exc:
        return _fail(EX_NOUSER, f"bad recipient address <{exc}>")
    if options.from_headers:
        found, message = header_recipients(message)
        recipients.extend(qualified(a, domain) for a in found)
    if not recipients:
        return _fail(EX_USAGE, "no recipients: name them as arguments, or use -t")
    for address in recipients:
        if isinstance(parse_mailbox(address, smtputf8=True), AddressProblem):
            return _fail(EX_NOUSER, f"bad recipient address <{address}>")
    if options.sender is not None:
        sender = qualified(options.sender, domain)
        if sender and isinstance(parse_mailbox(sender, smtputf8=True), AddressProblem):
            return _fail(EX_USAGE, f"bad sender address <{sender}> (-f)")
    else:
        sender = f"{user}@{domain}"
        if isinstance(parse_mailbox(sender, smtputf8=True), AddressProblem):
            sender = f"MAILER-DAEMON@{domain}"  # a user name that is no local part
    if limit := settings.limits.max_message_size:
        if len(message) > limit:
            return _fail(EX_DATAERR, f"the message is {len(message)} bytes; limits allow {limit}")
    author = sender or f"MAILER-DAEMON@{settings.server.hostname}"
    message = with_from(message, author, options.full_name)
    try:
        location = store_connect.locate_database(settings)
        pool = await store_connect.create_pool(location.url, settings, size=1)  # one message
    except DB_ERRORS as exc:
        return _fail(EX_TEMPFAIL, f"the queue cannot be reached now: {redact(str(exc))}")
    except (DatabaseUnavailable, OSError, TimeoutError) as exc:
        return _fail(EX_TEMPFAIL, f"the queue cannot be reached now: {redact(str(exc))}")
    try:
        intake = Intake.of(settings, pool)
        queued = await intake.accept(
            Submission(
                door=Door(listener=LISTENER, trace="http", via=f"sendmail from local user {user}"),
                submitter=Submitter(org_id=None),
                sender=sender,
                recipients=tuple(dict.fromkeys(recipients)),
                data=message,
            )
        )
        if isinstance(queued, Refusal):
            return _refused(queued)
        await _wake(pool)
    finally:
        await pool.close()
    if options.verbose:
        print(f"queued as {queued.queue_id}", file=sys.stderr)
    return EX_OK


def _refused(refusal: Refusal) -> int:
    if refusal.passes:
        return _fail(EX_TEMPFAIL, f"not queued, try again later: {refusal.reason.value}")
    if refusal.reason is Reason.BAD_INTENT:
        return _fail(EX_DATAERR, f"{refusal.intent_field}: {refusal.intent_problem}")
    return _fail(EX_DATAERR, f"not queued: {refusal.reason.value}")


async def _wake(pool: asyncpg.Pool) -> None:
    """A running serve's engines hear of the message at once (they poll otherwise)."""
    try:
        await asyncio.wait_for(pool.execute("SELECT pg_notify($1, '')", NOTIFY_CHANNEL), 5)
    except DB_ERRORS as exc:
        log.debug("no NOTIFY for the queued message: %s", exc)
    except TimeoutError:
        log.debug("no NOTIFY for the queued message: no answer within 5 s")
