"""The sender policy: which MAIL FROM and originator-field addresses a client may use, the rate
limit of an AUTH credential, and the org a message is queued for.

`relay.sender_policy` decides how far an authenticated client's addresses must belong to its org:
"off" checks nothing, otherwise MAIL FROM must be at one of the org's domains, and "strict" asks
the same of every From:, Sender:, Resent-From: and Resent-Sender: address. A client on a trusted
network has no org of its own: its messages belong to `relay.trusted_org`. Every refusal is a
reply constant from `replies`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from pigeon_mta.header_bounds import FieldBounds, FieldProblem, split_addresses
from pigeon_mta.message import address_domains
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import limits as store_limits
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.submission import replies
from pigeon_mta.submission.addresses import Mailbox
from pigeon_mta.submission.context import Conversation, ListenerContext

log = logging.getLogger("pigeon_mta.submission")


@dataclass(frozen=True)
class Unreadable:
    """An originator field that cannot be read within the bounds."""

    name: str  # the field's name, lower case ("from", "sender", ...)
    value: str  # the field as written
    problem: FieldProblem


def originator_domains(
    fields: list[tuple[str, str]], bounds: FieldBounds, *, strict: bool
) -> dict[str, set[str]] | Unreadable:
    """The domains each originator field (`message.ORIGINATOR_FIELDS`: name, value) names, or the
    first field that cannot be read. Every From: is measured (header_bounds.py), whatever the
    policy: one that cannot be parsed within the bounds is refused rather than queued for the DKIM
    signer to choke on. Only `strict` reads the other fields, and the domains (none otherwise)."""
    domains: dict[str, set[str]] = {}
    for name, value in fields:
        if name != "from" and not strict:
            continue
        read = address_domains(value, bounds) if strict else split_addresses(value, bounds)
        if isinstance(read, FieldProblem):
            return Unreadable(name, value, read)
        if strict:
            assert isinstance(read, set)
            domains.setdefault(name, set()).update(read)
    return domains


class SenderPolicy:
    """One per listener; what it learns about one connection's org is kept on the Conversation."""

    def __init__(self, ctx: ListenerContext) -> None:
        self.ctx = ctx
        self.from_bounds = FieldBounds(ctx.limits.max_from_addresses, ctx.limits.max_from_length)

    async def check_authenticated_sender(
        self, conv: Conversation, sender: Mailbox | None
    ) -> str | None:
        """The refusal of an AUTH client's MAIL FROM, or None (raises on database trouble)."""
        assert conv.login is not None
        if sender is not None and self.ctx.sender_policy != "off":
            if not await self._org_owns(conv, sender.domain):
                log.warning(
                    "MAIL refused: user=%s may not send as <%s>", conv.login.username, sender
                )
                return replies.SENDER_NOT_OWNED
        limit = self.ctx.limits.credential_rate_limit
        if limit > 0:
            recent = await store_limits.recent_messages_of_credential(
                self.ctx.pool,
                conv.login.id,
                window=self.ctx.limits.credential_rate_window,
                up_to=limit,
            )
            if recent >= limit:
                log.warning(
                    "MAIL deferred: user=%s reached its rate limit (%d per %gs)",
                    conv.login.username,
                    limit,
                    self.ctx.limits.credential_rate_window,
                )
                return replies.RATE_LIMITED
        return None

    async def check_originators(
        self, conv: Conversation, fields: list[tuple[str, str]]
    ) -> str | None:
        """The originator fields of a message (`message.ORIGINATOR_FIELDS`) against the policy.

        Every client's From: is measured (header_bounds.py): one that cannot be parsed within the
        bounds is refused here rather than queued for the DKIM signer to choke on. With the strict
        sender policy an AUTH user's message must also name a From: address, and every From:,
        Sender:, Resent-From: and Resent-Sender: address must be at one of its org's domains.
        """
        strict = conv.login is not None and self.ctx.sender_policy == "strict"
        domains = originator_domains(fields, self.from_bounds, strict=strict)
        if isinstance(domains, Unreadable):
            log.warning(
                "DATA from [%s] refused: its %s: header %s (%d characters)",
                conv.client_ip,
                domains.name,
                domains.problem.value,
                len(domains.value),
            )
            return replies.FIELD_UNREADABLE[domains.name, domains.problem]
        if not strict:
            return None
        assert conv.login is not None
        if not domains.get("from"):
            log.warning("DATA refused: user=%s sent no From: address", conv.login.username)
            return replies.NO_FROM
        try:
            for name, named in domains.items():
                for domain in sorted(named):
                    if not await self._org_owns(conv, domain):
                        log.warning(
                            "DATA refused: user=%s may not use %s: @%s",
                            conv.login.username,
                            name,
                            domain,
                        )
                        return replies.FIELD_NOT_OWNED[name]
        except DB_ERRORS as exc:
            log.warning("DATA from [%s]: database trouble: %s", conv.client_ip, exc)
            return replies.DATABASE_TROUBLE
        return None

    async def org_of(self, conv: Conversation) -> uuid.UUID | None:
        """The org a message is queued for; None on database trouble (already logged)."""
        if conv.login is not None:
            return conv.login.org_id
        try:
            return await self.ctx.trusted_org_id()
        except DB_ERRORS as exc:
            log.warning("cannot look up the trusted org: %s", exc)
            return None

    async def _org_owns(self, conv: Conversation, domain: str) -> bool:
        assert conv.login is not None
        known = conv.sender_domains.get(domain)
        if known is None:
            known = await store_domains.org_may_send_as(self.ctx.pool, conv.login.org_id, domain)
            conv.sender_domains[domain] = known
        return known
