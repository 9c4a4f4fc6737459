"""The sender policy and the rate limit for API mail: the rules of submission/policy.py, worded as
problems.

`relay.sender_policy` holds as for an SMTP AUTH user, the API key standing for the user: "off"
checks nothing; otherwise the envelope sender must be at one of the org's sender domains; "strict"
also asks it of every From:, Sender:, Resent-From: and Resent-Sender: address, and a message must
name a From: address. Every From: is measured against `limits.max_from_*` whatever the policy, as
for SMTP mail. `limits.credential_rate_limit` counts a key's messages as it counts a user's.

What one request learns of its org's sender domains is kept for the rest of that request (`owned`,
as an SMTP conversation keeps it), so that the usual message, whose From: is at the envelope
sender's domain, costs one look-up and not two. Across requests the process remembers that a domain
is the org's for `api.auth_cache` (memo.py): a domain removed from the org is refused at the latest
that long after its removal, and with 0 from the next request on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import asyncpg

from pigeon_mta.api import problems
from pigeon_mta.api.memo import Memo
from pigeon_mta.api.problems import Problem
from pigeon_mta.config import Settings
from pigeon_mta.header_bounds import FieldBounds
from pigeon_mta.store import apikeys as store_apikeys
from pigeon_mta.store import domains as store_domains
from pigeon_mta.store.apikeys import ApiKey
from pigeon_mta.submission.addresses import Mailbox
from pigeon_mta.submission.policy import Unreadable, originator_domains

# What a client is told to wait when its key is over its rate (at most the window).
_RATE_RETRY_AFTER = 60

_FIELD_NAMES = {
    "from": "From",
    "sender": "Sender",
    "resent-from": "Resent-From",
    "resent-sender": "Resent-Sender",
}


class ApiSenderPolicy:
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
        self._owned: Memo[tuple[uuid.UUID, str], bool] = Memo(settings.api.auth_cache, clock=clock)

    async def check_rate(self, key: ApiKey) -> None:
        """429 when the key has sent its `limits.credential_rate_limit` (raises on DB trouble)."""
        limits = self.settings.limits
        if limits.credential_rate_limit <= 0:
            return
        recent = await store_apikeys.recent_messages_of_key(
            self.pool,
            key.id,
            window=limits.credential_rate_window,
            up_to=limits.credential_rate_limit,
        )
        if recent >= limits.credential_rate_limit:
            raise Problem(
                problems.RATE_LIMITED,
                f"The API key has sent {recent} messages within limits.credential_rate_window "
                f"({limits.credential_rate_window:g}s), as many as limits.credential_rate_limit "
                "allows.",
                retry_after=int(min(_RATE_RETRY_AFTER, limits.credential_rate_window)) or 1,
            )

    async def check_sender(self, key: ApiKey, sender: Mailbox, owned: dict[str, bool]) -> None:
        """403 unless the org may send as the envelope sender (raises on DB trouble). `owned`:
        the request's answers so far, by domain."""
        if self.settings.relay.sender_policy == "off":
            return
        if not await self._org_owns(key, sender.domain, owned):
            raise Problem(
                problems.SENDER_NOT_OWNED,
                f"The sender '{sender}' in 'from' is not at one of the sender domains of the "
                f"org '{key.org}'.",
            )

    async def check_originators(
        self, key: ApiKey, fields: list[tuple[str, str]], owned: dict[str, bool]
    ) -> None:
        """The originator fields of the message (name, value) against the policy."""
        strict = self.settings.relay.sender_policy == "strict"
        domains = originator_domains(fields, self.from_bounds, strict=strict)
        if isinstance(domains, Unreadable):
            raise Problem(
                problems.INVALID_HEADER,
                f"The {_FIELD_NAMES[domains.name]}: field of the message {domains.problem.value}.",
            )
        if not strict:
            return
        if not domains.get("from"):
            raise Problem(problems.INVALID_HEADER, "The message has no From: address.")
        for name, named in domains.items():
            for domain in sorted(named):
                if not await self._org_owns(key, domain, owned):
                    raise Problem(
                        problems.SENDER_NOT_OWNED,
                        f"The {_FIELD_NAMES[name]}: field names @{domain}, which is not a "
                        f"sender domain of the org '{key.org}'.",
                    )

    async def _org_owns(self, key: ApiKey, domain: str, owned: dict[str, bool]) -> bool:
        known = owned.get(domain)
        if known is None:
            known = await self._owned.get(
                (key.org_id, domain),
                lambda: store_domains.org_may_send_as(self.pool, key.org_id, domain),
            )
            owned[domain] = known
        return known
