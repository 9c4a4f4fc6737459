"""The aiosmtpd handler: the hooks of a submission in the order they run (AUTH, MAIL, RCPT, DATA).

Hooks receive the connection (`server`, a `protocol.SMTPSession`); per-connection facts live on its
`conversation`. Every decision is a reply constant from `replies`. The SASL exchange of AUTH is
`sasl.SaslExchange`'s. MAIL asks the intake (intake/accept.py) whether the envelope sender is the
org's and the user within its rate; DATA hands the message to the intake, whose commit comes
before the 250, and answers its refusals with `reply_of`.
"""

from __future__ import annotations

import logging
from typing import Any

from aiosmtpd.smtp import MISSING, AuthResult, Envelope, Session, TLSSetupException

from pigeon_mta.intake import lanes
from pigeon_mta.intake.addresses import AddressProblem, Mailbox, mailbox_key, parse_mailbox
from pigeon_mta.intake.refusal import Reason, Refusal
from pigeon_mta.intake.submission import Door, Submission, Submitter
from pigeon_mta.submission import replies
from pigeon_mta.submission.context import Conversation, ListenerContext, conversation
from pigeon_mta.submission.mail_params import TransactionEnvelope
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
            refusal = await self.ctx.intake.check_sender(
                submitter_of(conv), sender.domain if sender else None, conv.sender_domains
            )
            if refusal is not None:
                return reply_of(refusal)
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
        if mailbox_key(mailbox) in {mailbox_key(r) for r in envelope.rcpt_tos}:
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
        raw = envelope.original_content
        assert isinstance(raw, bytes)
        submission = Submission(
            door=Door(
                listener=self.ctx.name,
                lane=self.ctx.listener.lane,
                client_ip=conv.client_ip,
                helo=conv.helo,
                esmtp=conv.esmtp,
                smtputf8=bool(envelope.smtp_utf8),
                tls_version=conv.tls_version,
                tls_cipher=conv.tls_cipher,
                # Recorded only: the client's claim, never a policy input (mail_params.py).
                auth_param=envelope.auth_param
                if isinstance(envelope, TransactionEnvelope)
                else None,
            ),
            submitter=submitter_of(conv),
            sender="" if envelope.mail_from == NULL_SENDER_MARK else str(envelope.mail_from),
            recipients=tuple(envelope.rcpt_tos),
            data=raw,
            sender_checked=True,  # at MAIL
            owned=conv.sender_domains,
        )
        # Shutdown waits for the commits under way (service.py).
        server.enqueuing += 1
        try:
            queued = await self.ctx.intake.accept(submission)
        finally:
            server.enqueuing -= 1
        if isinstance(queued, Refusal):
            return reply_of(queued)
        return replies.QUEUED.format(queue_id=queued.queue_id)

    # ------------------------------------------------------------ errors

    async def handle_exception(self, error: Exception) -> str:
        return exception_reply(error, "an SMTP session")


def exception_reply(error: Exception, where: str) -> str:
    """The reply to an error aiosmtpd caught in a session: a failed TLS handshake is the client's
    trouble (logged as information); anything else is logged with its traceback."""
    if isinstance(error, TLSSetupException):
        log.info("TLS handshake failed: %s", error.__cause__ or error)
        return replies.TLS_FAILED
    log.error("unexpected error in %s", where, exc_info=error)
    return replies.LOCAL_ERROR


_NAMES: dict[tuple[type, tuple[str, ...]], list[str]] = {}


def names_with_prefixes(cls: type, prefixes: tuple[str, ...]) -> list[str]:
    """The attribute names of `cls` that aiosmtpd looks up by prefix (computed once per class)."""
    names = _NAMES.get((cls, prefixes))
    if names is None:
        names = _NAMES[cls, prefixes] = sorted(n for n in dir(cls) if n.startswith(prefixes))
    return names


def submitter_of(conv: Conversation) -> Submitter:
    login = conv.login
    if login is None:
        return Submitter(org_id=None)  # a trusted client: relay.trusted_org's
    return Submitter(
        org_id=login.org_id,
        auth_user=login.username,
        credential_id=login.id,
        lane=login.lane,
    )


def reply_of(refusal: Refusal) -> str:
    """The SMTP reply an intake's refusal is answered with."""
    reason = refusal.reason
    if reason is Reason.FIELD_NOT_OWNED:
        return replies.FIELD_NOT_OWNED[refusal.field or "from"]
    if reason is Reason.FIELD_UNREADABLE:
        assert refusal.field is not None and refusal.problem is not None
        return replies.FIELD_UNREADABLE[refusal.field, refusal.problem]
    if reason is Reason.UNKNOWN_LANE:
        return replies.UNKNOWN_LANE.format(lane=refusal.lanes[0])
    if reason is Reason.LANES_DIFFER:
        return replies.LANES_DIFFER.format(lanes=lanes.shown(", ".join(refusal.lanes)))
    if reason is Reason.BAD_INTENT:
        return replies.BAD_INTENT.format(
            field=lanes.shown(refusal.intent_field), problem=refusal.intent_problem
        )
    return _REPLIES[reason]


_REPLIES = {
    Reason.SENDER_NOT_OWNED: replies.SENDER_NOT_OWNED,
    Reason.NO_FROM: replies.NO_FROM,
    Reason.RATE_LIMITED: replies.RATE_LIMITED,
    Reason.HEADER_TOO_LARGE: replies.HEADER_TOO_BIG,
    Reason.TOO_MANY_HOPS: replies.TOO_MANY_HOPS,
    Reason.DATABASE_TROUBLE: replies.DATABASE_TROUBLE,
    Reason.COMMIT_FAILED: replies.DATABASE_TROUBLE,
}
