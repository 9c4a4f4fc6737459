"""The aiosmtpd handler: the hooks of a submission in the order they run (AUTH, MAIL, RCPT, DATA),
and the enqueue that must commit before the 250.

Hooks receive the connection (`server`, a `protocol.SMTPSession`); per-connection facts live on its
`conversation`. Every decision is a reply constant from `replies`. The SASL exchange of AUTH is
`sasl.SaslExchange`'s; which senders an org may use is `policy.SenderPolicy`'s.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

from aiosmtpd.smtp import MISSING, AuthResult, Envelope, Session, TLSSetupException

from pigeon_mta import model
from pigeon_mta.ids import new_id
from pigeon_mta.message import HeaderTooLarge
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.duplicates import Duplicates
from pigeon_mta.submission import replies
from pigeon_mta.submission.addresses import AddressProblem, Mailbox, parse_mailbox
from pigeon_mta.submission.context import ListenerContext, conversation
from pigeon_mta.submission.fixups import TooManyHops, Trace, apply_fixups
from pigeon_mta.submission.lanes import choose_lane
from pigeon_mta.submission.mail_params import TransactionEnvelope
from pigeon_mta.submission.policy import SenderPolicy
from pigeon_mta.submission.reception import Reception, announce
from pigeon_mta.submission.sasl import SaslExchange

log = logging.getLogger("pigeon_mta.submission")

# The null reverse-path, MAIL FROM:<> (RFC 5321 section 4.5.5), as `split_path` gives it and as the
# envelope carries it from MAIL to the commit.
NULL_SENDER_MARK = "<>"  # aiosmtpd needs a true value for "MAIL was given"; "" is stored

_ADDRESS_REPLIES = {
    AddressProblem.SYNTAX: replies.BAD_RECIPIENT,
    AddressProblem.NEEDS_SMTPUTF8: replies.NEEDS_SMTPUTF8,
    AddressProblem.LITERAL: replies.LITERAL_RECIPIENT,
}


class SubmissionHandler:
    """One per listener. Attribute names matter to aiosmtpd: handle_* are hooks, auth_* are
    AUTH mechanisms; nothing else may start with either."""

    def __init__(self, ctx: ListenerContext) -> None:
        self.ctx = ctx
        self.sasl = SaslExchange(ctx)
        self.policy = SenderPolicy(ctx)

    def __dir__(self) -> list[str]:
        # aiosmtpd looks through dir() of the handler on every new connection (see
        # SMTPSession.__dir__): list only what it looks for.
        return names_with_prefixes(type(self), ("handle_", "auth_"))

    # ------------------------------------------------------------ AUTH

    async def handle_AUTH(
        self, server: Any, session: Session, envelope: Envelope, args: list[str]
    ) -> Any:
        if envelope.mail_from:
            return replies.AUTH_IN_TRANSACTION
        refusal = await self.sasl.refusal_to_start(server)
        return refusal if refusal is not None else MISSING

    async def auth_PLAIN(self, server: Any, args: list[str]) -> AuthResult:
        return await self.sasl.plain(server, args)

    async def auth_LOGIN(self, server: Any, args: list[str]) -> AuthResult:
        return await self.sasl.login(server, args)

    # ------------------------------------------------------------ envelope

    async def handle_MAIL(
        self, server: Any, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        conv = conversation(server)
        if conv.login is None and not conv.trusted and self.ctx.mode != "relay":
            return replies.AUTH_REQUIRED
        # On a relay listener an untrusted, unauthenticated client may say MAIL; every RCPT is
        # then refused (relay access denied), whatever the address looks like.
        sender: Mailbox | None = None
        if address != NULL_SENDER_MARK:
            parsed = parse_mailbox(address, smtputf8=bool(envelope.smtp_utf8))
            if not isinstance(parsed, Mailbox):
                return (
                    replies.NEEDS_SMTPUTF8
                    if parsed is AddressProblem.NEEDS_SMTPUTF8
                    else replies.BAD_SENDER
                )
            sender = parsed
        if conv.login is not None:
            try:
                refusal = await self.policy.check_authenticated_sender(conv, sender)
            except DB_ERRORS as exc:
                log.warning("MAIL from [%s]: database trouble: %s", conv.client_ip, exc)
                return replies.DATABASE_TROUBLE
            if refusal:
                return refusal
        envelope.mail_from = str(sender) if sender else NULL_SENDER_MARK
        envelope.mail_options.extend(options)
        return replies.SENDER_OK

    async def handle_RCPT(
        self, server: Any, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        conv = conversation(server)
        if conv.login is None and not conv.trusted:
            log.info("RCPT refused: [%s] is not trusted and did not AUTH", conv.client_ip)
            return replies.RELAY_DENIED
        if len(envelope.rcpt_tos) >= self.ctx.limits.max_recipients:
            return replies.TOO_MANY_RECIPIENTS
        parsed = parse_mailbox(address, smtputf8=bool(envelope.smtp_utf8))
        if not isinstance(parsed, Mailbox):
            return _ADDRESS_REPLIES[parsed]
        mailbox = str(parsed)
        if _mailbox_key(mailbox) in {_mailbox_key(r) for r in envelope.rcpt_tos}:
            # The same recipient twice in one envelope is delivered once (as Postfix does).
            return replies.RECIPIENT_OK
        envelope.rcpt_tos.append(mailbox)
        envelope.rcpt_options.extend(options)
        return replies.RECIPIENT_OK

    # ------------------------------------------------------------ message

    async def handle_DATA(self, server: Any, session: Session, envelope: Envelope) -> str:
        conv = conversation(server)
        # The DATA timer must not cut the connection while the commit is under way.
        server.restart_command_timer()
        org_id = await self.policy.org_of(conv)
        if org_id is None:
            return replies.DATABASE_TROUBLE
        sender = "" if envelope.mail_from == NULL_SENDER_MARK else str(envelope.mail_from)
        recipients = tuple(envelope.rcpt_tos)
        queue_id = new_id()
        received_at = datetime.now(UTC)
        raw = envelope.original_content
        assert isinstance(raw, bytes)
        new_message_id = f"{new_id().hex}@{self.ctx.hostname}"
        try:
            fixed = apply_fixups(
                raw,
                Trace(
                    hostname=self.ctx.hostname,
                    queue_id=str(queue_id),
                    client_ip=conv.client_ip,
                    helo=conv.helo,
                    esmtp=conv.esmtp,
                    smtputf8=bool(envelope.smtp_utf8),
                    tls_version=conv.tls_version,
                    tls_cipher=conv.tls_cipher,
                    auth_user=conv.login.username if conv.login else None,
                    recipients=recipients,
                    received_at=received_at,
                ),
                new_message_id=new_message_id,
                max_header_size=self.ctx.limits.max_header_size,
                max_hops=self.ctx.limits.max_hops,
            )
        except HeaderTooLarge:
            log.info(
                "message from [%s] refused: its header section is over limits.max_header_size "
                "(%d bytes)",
                conv.client_ip,
                self.ctx.limits.max_header_size,
            )
            return replies.HEADER_TOO_BIG
        except TooManyHops:
            log.warning(
                "message from [%s] refused: %d or more Received fields (limits.max_hops), "
                "a routing loop?",
                conv.client_ip,
                self.ctx.limits.max_hops,
            )
            return replies.TOO_MANY_HOPS
        refusal = await self.policy.check_originators(conv, fixed.address_fields)
        if refusal:
            return refusal
        lane = choose_lane(
            fixed.lane_fields,
            user=conv.login.username if conv.login else None,
            user_lane=conv.login.lane if conv.login else None,
            listener_lane=self.ctx.listener.lane,
            lanes=self.ctx.settings.lanes,
            header=self.ctx.settings.lane_header,
        )
        if lane.refusal:
            log.info("message from [%s] refused: %s", conv.client_ip, lane.refusal)
            return lane.refusal
        if lane.overruled:
            log.info(
                "message from [%s] stays in lane '%s': %s",
                conv.client_ip,
                lane.lane,
                lane.overruled,
            )
        message = model.Envelope(
            org_id=org_id,
            sender=sender,
            recipients=recipients,
            body=fixed.data,
            listener=self.ctx.name,
            header_message_id=fixed.header_message_id,
            client_ip=conv.client_ip,
            client_helo=_printable(conv.helo),
            credential_id=conv.login.id if conv.login else None,
            auth_user=conv.login.username if conv.login else None,
            received_at=received_at,
            tls_version=conv.tls_version,
            tls_cipher=conv.tls_cipher,
            # Only a Message-ID the client supplied says "the same message again".
            duplicate_window=self.ctx.limits.duplicate_window
            if fixed.header_message_id != new_message_id
            else 0.0,
            content_key=fixed.content_digest,
            lane=lane.lane,
        )
        reception = Reception(
            queue_id=queue_id,
            org_id=org_id,
            listener=self.ctx.name,
            client_ip=conv.client_ip,
            helo=message.client_helo,
            auth_user=message.auth_user,
            sender=sender,
            recipients=recipients,
            size=len(fixed.data),
            header_message_id=fixed.header_message_id,
            tls=f"{conv.tls_version} {conv.tls_cipher}" if conv.tls_version else None,
            received_at=received_at,
            # Recorded only: the client's claim, never a policy input (mail_params.py).
            auth_param=envelope.auth_param if isinstance(envelope, TransactionEnvelope) else None,
            lane=lane.lane,
        )
        try:
            duplicates = await self._enqueue(server, message, reception)
        except DB_ERRORS as exc:
            log.warning(
                "not queued (451 sent): client=[%s] from=<%s> nrcpt=%d: database trouble: %s",
                conv.client_ip,
                sender,
                len(recipients),
                exc,
            )
            return replies.DATABASE_TROUBLE
        return replies.QUEUED.format(queue_id=self._announce(message, reception, duplicates))

    async def _enqueue(
        self, server: Any, message: model.Envelope, reception: Reception
    ) -> Duplicates | None:
        """Commit the message; returns its recipients that were not queued again, if any.
        Shielded: a client that hangs up mid-commit does not cancel the statement half-way; a
        message committed anyway is announced all the same."""
        # No NOTIFY inside the transaction (it would serialise commits): the group commit hands
        # the message to this process's engine or wakes the engines after the commit
        # (store/notify.py). Messages of other sessions that finish at the same time share the
        # commit (store/group_commit.py).
        task = asyncio.ensure_future(self.ctx.group_commit.enqueue(reception.queue_id, message))
        server.enqueuing += 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._orphan_outcome(done, message, reception))
            raise
        finally:
            server.enqueuing -= 1

    def _announce(
        self, message: model.Envelope, reception: Reception, duplicates: Duplicates | None
    ) -> uuid.UUID:
        """After the commit (which handed the message to an engine or woke the engines, see
        store/group_commit.py): see `reception.announce`."""
        return announce(message, reception, duplicates, delivery_log=self.ctx.delivery_log)

    def _orphan_outcome(
        self,
        task: asyncio.Future[Duplicates | None],
        message: model.Envelope,
        reception: Reception,
    ) -> None:
        """The commit of a message whose client hung up while it ran has ended."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.warning("a message whose client hung up during the commit was not queued: %s", exc)
            return
        queue_id = self._announce(message, reception, task.result())
        log.warning("message %s was queued but its client hung up before the reply", queue_id)

    # ------------------------------------------------------------ errors

    async def handle_exception(self, error: Exception) -> str:
        if isinstance(error, TLSSetupException):
            log.info("TLS handshake failed: %s", error.__cause__ or error)
            return replies.TLS_FAILED
        log.error("unexpected error in an SMTP session", exc_info=error)
        return replies.LOCAL_ERROR


_NAMES: dict[tuple[type, tuple[str, ...]], list[str]] = {}


def names_with_prefixes(cls: type, prefixes: tuple[str, ...]) -> list[str]:
    """The attribute names of `cls` that aiosmtpd looks up by prefix (computed once per class)."""
    names = _NAMES.get((cls, prefixes))
    if names is None:
        names = _NAMES[cls, prefixes] = sorted(n for n in dir(cls) if n.startswith(prefixes))
    return names


def _printable(text: str | None) -> str | None:
    if text is None:
        return None
    cleaned = "".join(
        c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else "?" for c in text
    )
    return cleaned[:255]


def _mailbox_key(address: str) -> str:
    """Two spellings of one mailbox: the local part as written, the domain in any case."""
    local, _, domain = address.rpartition("@")
    return f"{local}@{domain.lower()}"
