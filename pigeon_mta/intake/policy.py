"""The sender policy: which envelope sender and originator-field addresses a submitter may use,
and the rate of a credential.

`relay.sender_policy` decides how far an authenticated submitter's addresses (an SMTP AUTH user's
or an API key's) must belong to its org: "off" checks nothing, otherwise the envelope sender must
be at one of the org's domains, and "strict" asks the same of every From:, Sender:, Resent-From:
and Resent-Sender: address, and a message must name a From: address. A client on a trusted network
has no org of its own (its mail is `relay.trusted_org`'s) and is not checked. Every From: is
measured against `limits.max_from_*` whatever the policy: one that cannot be parsed within the
bounds is refused rather than queued for the DKIM signer to choke on.
`limits.credential_rate_limit` counts a user's and a key's messages alike.

What one connection or request learns of its org's sender domains is kept with it
(`Submission.owned`), so that the usual message, whose From: is at the envelope sender's domain,
costs one look-up and not two. An API key's yes-answers are also remembered by the process for
`api.auth_cache` (pigeon_mta/memo.py), as its key is: a domain removed from the org is refused
to API mail at the latest that long after its removal.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.header_bounds import FieldBounds, FieldProblem, split_addresses
from pigeon_mta.intake.refusal import Reason, Refusal
from pigeon_mta.intake.submission import Submitter
from pigeon_mta.memo import Memo
from pigeon_mta.message import address_domains
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store import limits as store_limits

log = logging.getLogger("pigeon_mta.intake")


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
    first field that cannot be read. Every From: is measured (header_bounds.py); only `strict`
    reads the other fields, and the domains (none otherwise)."""
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
    """One per process, for every door. Methods raise on database trouble."""

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.pool = pool
        limits = settings.limits
        self.from_bounds = FieldBounds(limits.max_from_addresses, limits.max_from_length)
        self._remembered: Memo[tuple[uuid.UUID, str], bool] = Memo(
            settings.api.auth_cache, clock=clock
        )

    async def check_rate(self, submitter: Submitter) -> Refusal | None:
        """RATE_LIMITED once the credential has sent `limits.credential_rate_limit` messages
        within `limits.credential_rate_window`."""
        limits = self.settings.limits
        limit = limits.credential_rate_limit
        if limit <= 0 or not submitter.authenticated:
            return None
        recent = await store_limits.recent_messages(
            self.pool,
            credential_id=submitter.credential_id,
            api_key_user=submitter.auth_user if submitter.api_key else None,
            window=limits.credential_rate_window,
            up_to=limit,
        )
        if recent < limit:
            return None
        log.warning(
            "deferred: %s reached its rate limit (%d per %gs)",
            _who(submitter),
            limit,
            limits.credential_rate_window,
        )
        return Refusal(Reason.RATE_LIMITED, recent=recent)

    async def check_sender(
        self, submitter: Submitter, domain: str | None, owned: dict[str, bool]
    ) -> Refusal | None:
        """SENDER_NOT_OWNED unless the org may send as the envelope sender's `domain` (None: the
        null sender). `owned`: the connection's or request's answers so far, by domain."""
        if domain is None or not submitter.authenticated:
            return None
        if self.settings.relay.sender_policy == "off":
            return None
        if await self._org_owns(submitter, domain, owned):
            return None
        log.warning("refused: %s may not send as @%s", _who(submitter), domain)
        return Refusal(Reason.SENDER_NOT_OWNED, domain=domain)

    async def check_originators(
        self,
        submitter: Submitter,
        fields: list[tuple[str, str]],
        owned: dict[str, bool],
        *,
        client: str,
    ) -> Refusal | None:
        """The originator fields of a message (`message.ORIGINATOR_FIELDS`: name, value) against
        the policy; `client` names the sender in the log."""
        strict = submitter.authenticated and self.settings.relay.sender_policy == "strict"
        domains = originator_domains(fields, self.from_bounds, strict=strict)
        if isinstance(domains, Unreadable):
            log.warning(
                "message from %s refused: its %s: header %s (%d characters)",
                client,
                domains.name,
                domains.problem.value,
                len(domains.value),
            )
            return Refusal(Reason.FIELD_UNREADABLE, field=domains.name, problem=domains.problem)
        if not strict:
            return None
        if not domains.get("from"):
            log.warning("refused: %s sent no From: address", _who(submitter))
            return Refusal(Reason.NO_FROM, field="from")
        for name, named in domains.items():
            for domain in sorted(named):
                if not await self._org_owns(submitter, domain, owned):
                    log.warning("refused: %s may not use %s: @%s", _who(submitter), name, domain)
                    return Refusal(Reason.FIELD_NOT_OWNED, field=name, domain=domain)
        return None

    async def _org_owns(self, submitter: Submitter, domain: str, owned: dict[str, bool]) -> bool:
        org_id = submitter.org_id
        assert org_id is not None
        known = owned.get(domain)
        if known is None:
            if submitter.api_key:
                known = await self._remembered.get(
                    (org_id, domain),
                    lambda: store_domains.org_may_send_as(self.pool, org_id, domain),
                )
            else:
                known = await store_domains.org_may_send_as(self.pool, org_id, domain)
            owned[domain] = known
        return known


def _who(submitter: Submitter) -> str:
    return str(submitter.auth_user) if submitter.api_key else f"user={submitter.auth_user}"
