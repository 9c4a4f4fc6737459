"""The hooks of a `feedback` listener: where bounces that arrive later and complaint reports come
back (the MX of the return-path domains, port 25 style).

It takes mail for the return-path domains (feedback/return_paths.py) and for `[bounces]
complaint_addresses`, and for nothing else: every other recipient is refused `550 5.7.1`, so it
never relays. No AUTH, any sender (bounces come from the null sender). What it accepts it keeps
before its 250 (store/feedback.py `keep`: once per report), and wakes this process's feedback
processor, which reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiosmtpd.smtp import Envelope, Session

from pigeon_mta.feedback.return_paths import ReturnPaths
from pigeon_mta.intake.addresses import AddressProblem, Mailbox, parse_mailbox
from pigeon_mta.message import message_id_of, split_header
from pigeon_mta.store import feedback as store_feedback
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.submission import replies
from pigeon_mta.submission.context import ListenerContext, conversation
from pigeon_mta.submission.handler import NULL_SENDER_MARK, exception_reply, names_with_prefixes

log = logging.getLogger("pigeon_mta.feedback")

NOT_HERE = (
    "550 5.7.1 <{address}>: this host takes only bounces and complaint reports for its domains"
)
KEPT = "250 2.0.0 Ok: kept as {feedback_id}"
KEEP_FAILED = "451 4.3.0 Temporary failure keeping the message, try again later"


class FeedbackHandler:
    """One per feedback listener (aiosmtpd's hooks: only handle_* names)."""

    def __init__(
        self,
        ctx: ListenerContext,
        return_paths: ReturnPaths,
        complaint_addresses: tuple[str, ...],
        on_kept: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.return_paths = return_paths
        self.complaint_addresses = frozenset(a.lower() for a in complaint_addresses)
        self.on_kept = on_kept

    def __dir__(self) -> list[str]:
        return names_with_prefixes(type(self), ("handle_",))

    def takes(self, mailbox: Mailbox) -> bool:
        """Whether mail to this address is feedback this listener takes."""
        if str(mailbox).lower() in self.complaint_addresses:
            return True
        return mailbox.domain.lower() in self.return_paths.domains()

    async def handle_MAIL(
        self, server: Any, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if address != NULL_SENDER_MARK:
            parsed = parse_mailbox(address, smtputf8=bool(envelope.smtp_utf8))
            if not isinstance(parsed, Mailbox):
                return replies.BAD_SENDER
            address = str(parsed)
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return replies.SENDER_OK

    async def handle_RCPT(
        self, server: Any, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if len(envelope.rcpt_tos) >= self.ctx.limits.max_recipients:
            return replies.TOO_MANY_RECIPIENTS
        parsed = parse_mailbox(address, smtputf8=bool(envelope.smtp_utf8))
        if not isinstance(parsed, Mailbox):
            if parsed is AddressProblem.NEEDS_SMTPUTF8:
                return replies.NEEDS_SMTPUTF8
            return replies.BAD_RECIPIENT
        if not self.takes(parsed):
            log.info(
                "feedback listener %s refused RCPT <%s> from [%s]: not a feedback address",
                self.ctx.name,
                parsed,
                conversation(server).client_ip,
            )
            return NOT_HERE.format(address=parsed)
        envelope.rcpt_tos.append(str(parsed))
        envelope.rcpt_options.extend(options)
        return replies.RECIPIENT_OK

    async def handle_DATA(self, server: Any, session: Session, envelope: Envelope) -> str:
        conv = conversation(server)
        server.restart_command_timer()
        raw = envelope.original_content
        assert isinstance(raw, bytes)
        header_id = message_id_of(split_header(raw).fields)
        server.enqueuing += 1
        try:
            feedback_id, new = await store_feedback.keep(
                self.ctx.pool,
                key=store_feedback.report_key(header_id, raw),
                listener=self.ctx.name,
                client_ip=conv.client_ip if conv.client_ip != "unknown" else None,
                helo=conv.helo,
                mail_from="" if envelope.mail_from == NULL_SENDER_MARK else str(envelope.mail_from),
                rcpt_to=envelope.rcpt_tos,
                body=raw,
            )
        except DB_ERRORS as exc:
            log.warning("feedback from [%s] not kept: database trouble: %s", conv.client_ip, exc)
            return KEEP_FAILED
        finally:
            server.enqueuing -= 1
        if new:
            log.info("feedback %s kept from [%s]", feedback_id, conv.client_ip)
            self.on_kept()
        else:
            log.info("feedback from [%s] is a repeat of %s", conv.client_ip, feedback_id)
        return KEPT.format(feedback_id=feedback_id)

    async def handle_exception(self, error: Exception) -> str:
        return exception_reply(error, "a feedback session")
