"""The return-path domains and VERP keys as one process knows them, refreshed from the database.

The engine asks it for each delivery's envelope sender (`split`): mail whose sender domain has a
return-path domain (`domain set DOMAIN --return-path`, else `[bounces] return_path_domain`) leaves
with `b-TOKEN@RETURN-PATH`, one transaction per recipient, since the token names the recipient.
The feedback listener asks which domains it takes mail for, and the feedback processor which keys
still verify. Everything is read every `REFRESH` seconds, in one statement for the domains (a
table of sender domains, not of mail): no message costs a query. Should the database be away at
start, mail leaves with its own sender until the first refresh succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Mapping, Sequence

import asyncpg

from pigeon_mta.config import Settings
from pigeon_mta.domains import normalize_domain
from pigeon_mta.feedback.tokens import SigningKey, return_path
from pigeon_mta.model import Delivery
from pigeon_mta.store import return_path as store_return_path
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.executor import transaction

log = logging.getLogger("pigeon_mta.feedback")

REFRESH = 30.0


class ReturnPaths:
    name = "return-paths"

    def __init__(self, settings: Settings, pool: asyncpg.Pool, *, refresh: float = REFRESH):
        self.pool = pool
        # A node with a feedback listener verifies tokens whether or not it sends with them.
        self.verifies = any(lsn.mode == "feedback" for lsn in settings.listener)
        self.refresh_every = refresh
        self.max_age = float(settings.bounces.feedback_max_age)
        self.default = (
            normalize_domain(settings.bounces.return_path_domain)
            if (settings.bounces.return_path_domain)
            else None
        )
        self._by_domain: dict[tuple[uuid.UUID, str], str] = {}
        self._domains: frozenset[str] = frozenset([self.default] if self.default else [])
        self._signing: SigningKey | None = None
        self._verifying: dict[int, SigningKey] = {}
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ the service

    async def start(self) -> None:
        try:
            await self.refresh()
        except DB_ERRORS as exc:
            log.warning(
                "return paths not read (mail leaves with its own sender until they are): %s", exc
            )
        self._task = asyncio.create_task(self._loop())

    async def stop(self, deadline: float) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_every)
            try:
                await self.refresh()
            except DB_ERRORS as exc:
                log.warning("return paths not refreshed: %s", exc)

    async def refresh(self) -> None:
        """Read the return paths, and the keys once there is one (a node that uses none makes
        no key)."""
        async with transaction(self.pool) as conn:
            rows = await conn.fetch(
                "SELECT org_id, domain, return_path FROM sender_domain WHERE return_path IS NOT NULL"
            )
            keys = None
            if rows or self.default or self.verifies:
                keys = await store_return_path.keys(conn, max_age=self.max_age)
        self._by_domain = {(r["org_id"], r["domain"]): r["return_path"] for r in rows}
        self._domains = frozenset(
            [*self._by_domain.values(), *([self.default] if self.default else [])]
        )
        if keys is not None:
            self._signing = SigningKey(keys.signing.id, keys.signing.secret)
            self._verifying = {k.id: SigningKey(k.id, k.secret) for k in keys.verifying.values()}

    # ------------------------------------------------------------ what it answers

    def domains(self) -> frozenset[str]:
        """The domains a feedback listener takes mail for (made at each refresh, asked at every
        RCPT)."""
        return self._domains

    def verifying(self) -> Mapping[int, SigningKey]:
        return self._verifying

    @property
    def signing(self) -> SigningKey | None:
        """The key new tokens are signed with (None until one is read)."""
        return self._signing

    def of(self, org_id: uuid.UUID, sender: str) -> str | None:
        """The return-path domain of mail from `sender` of this org; None for the null sender
        and when there is none."""
        if not sender:
            return None
        domain = normalize_domain(sender.rpartition("@")[2]) or ""
        return self._by_domain.get((org_id, domain), self.default)

    def split(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """The deliveries as they are sent: one per recipient, each with its VERP envelope sender,
        where a return path applies; the others as they are."""
        key = self._signing
        if key is None or not (self._by_domain or self.default):
            return list(deliveries)
        out: list[Delivery] = []
        for delivery in deliveries:
            domain = self.of(delivery.org_id, delivery.sender)
            if domain is None:
                out.append(delivery)
                continue
            out.extend(
                dataclasses.replace(
                    delivery,
                    recipients=(recipient,),
                    mail_from=return_path(key, recipient.id, domain),
                )
                for recipient in delivery.recipients
            )
        return out
