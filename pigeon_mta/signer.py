"""The sign stage of the outbound path: DKIM-sign a claimed delivery with its From: domain's keys.

`DkimSigner` is the engine's `sign` callable. It signs with the keys that are active when the
delivery is signed (right after the claim, so queued mail picks up a rotation), read from the
database and cached for a few seconds per (org, domain). It never drops or holds a message for a
content problem: a message it cannot or need not sign goes out unsigned and is counted. Either
way it says what it did (`Signed.dkim`), which the engine keeps with the attempt: "signed d=DOMAIN
s=SELECTOR", or "unsigned: " and the reason.

Each org's keys sign only that org's mail. Mail from trusted networks belongs to
`relay.trusted_org`; with `relay.sign_with_owner_key` that org's mail for a domain of another org
is signed with the owner's keys (the signer is then those domains' smarthost).

Signatures are made on the event loop, one per loop iteration: an RSA-2048 signature costs about
0.4 ms of CPU, so a claimed batch of a hundred signed in one go would stall every other connection
of the process for 40 ms, while one at a time, between the loop's I/O turns, holds the others up by
one signature at most (bench/dkim_bench.py part 2: timer lateness max 2.7 ms, against 16-19 ms on a
thread pool, whose threads contend with the loop for the GIL). Threads bought no throughput
either: the service runs one worker process per core, so the cores are busy already (end to end,
bench/e2e.py: 830 msgs/s on pools of two threads, 826-850 signing in turn; bench/README.md "DKIM
signing").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pigeon_mta import dkim
from pigeon_mta.config import Settings
from pigeon_mta.header_bounds import FieldBounds
from pigeon_mta.message import UnreadableHeader, from_domain
from pigeon_mta.metrics import DKIM_SIGNATURES, DKIM_UNSIGNED
from pigeon_mta.model import Delivery, Signed
from pigeon_mta.store import dkim_keys as store_dkim_keys
from pigeon_mta.store import orgs as store_orgs
from pigeon_mta.store.connect import DB_ERRORS
from pigeon_mta.store.executor import Executor

log = logging.getLogger(__name__)

# Unsigned reasons (the `reason` label of pigeon_dkim_unsigned_total).
UNSIGNED_NO_FROM = "no_from_domain"  # no single From: field with one domain
UNSIGNED_NO_KEY = "no_key"  # the org has no active key for the From: domain
UNSIGNED_MALFORMED = "malformed"  # the header section or its From: cannot be parsed for signing
# What `pigeon-mta log` says after "unsigned: " (no_key names the domain and org instead).
_UNSIGNED_TEXT = {
    UNSIGNED_NO_FROM: "no usable From: domain",
    UNSIGNED_MALFORMED: "malformed header section",
}

_DEFAULT_BOUNDS = FieldBounds()


class KeysUnavailable(Exception):
    """The keys for a delivery could not be read and none are cached: sign later, not unsigned.

    Sending unsigned mail for a domain that publishes DKIM (and perhaps DMARC p=reject) during a
    database blip would get it rejected; the engine treats this like any temporary local failure.
    """


@dataclass
class _CachedKeys:
    keys: tuple[dkim.SigningKey, ...]
    fetched_at: float


class DkimSigner:
    """`await signer(delivery)` -> the message bytes to send, signed when a key applies, and
    how they were signed or why not."""

    # Past this many cached (org, domain) pairs the cache is emptied: cheap, and bounds memory
    # when mail comes from many From: domains that have no keys.
    MAX_CACHED = 10_000

    def __init__(
        self,
        db: Executor,
        *,
        owner_key_org: str | None = None,
        cache_ttl: float = 5.0,
        stale_ttl: float = 600.0,
        clock: Callable[[], float] = time.time,  # for t=; tests pass a fixed one
        from_bounds: FieldBounds = _DEFAULT_BOUNDS,
    ) -> None:
        """`db`: a pool. `owner_key_org`: the org whose mail is signed with the keys of the org
        that owns its From: domain (see `from_settings`). `cache_ttl`: how long a key lookup is
        reused (how soon a rotation takes effect). `stale_ttl`: how long cached keys keep serving
        while the database is unreachable. `from_bounds`: how much of a From: field is parsed (the
        limits reception applies); a message beyond them goes unsigned."""
        self._from_bounds = from_bounds
        self._db = db
        self._owner_key_org = owner_key_org
        # Org names, for the owner-key rule and the no-key reason; an org is never renamed.
        self._org_names: dict[uuid.UUID, str] = {}
        self._cache_ttl = cache_ttl
        self._stale_ttl = stale_ttl
        self._clock = clock
        self._cache: dict[tuple[uuid.UUID, str], _CachedKeys] = {}
        self._lookups: dict[tuple[uuid.UUID, str], asyncio.Future[tuple[dkim.SigningKey, ...]]] = {}
        self._loaded: dict[uuid.UUID, dkim.SigningKey] = {}
        # Signatures waiting for their loop iteration, in arrival order (see the top).
        self._waiting: collections.deque[_SignJob] = collections.deque()

    @classmethod
    def from_settings(cls, db: Executor, settings: Settings) -> DkimSigner:
        relay = settings.relay
        return cls(
            db,
            owner_key_org=relay.trusted_org if relay.sign_with_owner_key else None,
            from_bounds=FieldBounds(
                settings.limits.max_from_addresses, settings.limits.max_from_length
            ),
        )

    async def __call__(self, delivery: Delivery) -> Signed:
        message = delivery.body
        try:
            domain = from_domain(message, self._from_bounds)
        except UnreadableHeader as exc:
            log.info("queue id %s goes unsigned: %s", delivery.queue_id, exc)
            return _unsigned(message, UNSIGNED_MALFORMED)
        if domain is None:
            return _unsigned(message, UNSIGNED_NO_FROM)
        keys = await self.keys_for(delivery.org_id, domain)
        if not keys:
            return _unsigned(message, UNSIGNED_NO_KEY, await self._no_key(delivery.org_id, domain))
        try:
            fields = await self._sign_in_turn(message, keys)
        except dkim.SigningError as exc:
            log.info("queue id %s goes unsigned: %s", delivery.queue_id, exc)
            return _unsigned(message, UNSIGNED_MALFORMED)
        for key in keys:
            DKIM_SIGNATURES.labels(algorithm=key.algorithm).inc()
        return Signed(
            fields + message, "signed " + ", ".join(f"d={k.domain} s={k.selector}" for k in keys)
        )

    async def _no_key(self, org_id: uuid.UUID, domain: str) -> str:
        """Why no key applied, naming the org whose keys were looked at."""
        try:
            org = await self._org_name(org_id)
        except DB_ERRORS:  # the keys came from the cache; the name is only for the reason
            org = str(org_id)
        if org == self._owner_key_org:
            return f"no key for {domain} in org {org} nor in the org that owns it"
        return f"no key for {domain} in org {org}"

    async def _org_name(self, org_id: uuid.UUID) -> str:
        name = self._org_names.get(org_id)
        if name is None:
            name = await store_orgs.org_name(self._db, org_id) or str(org_id)
            self._org_names[org_id] = name
        return name

    def _sign_in_turn(
        self, message: bytes, keys: tuple[dkim.SigningKey, ...]
    ) -> asyncio.Future[bytes]:
        """The DKIM-Signature fields for `message`, made in a later loop iteration of their own."""
        loop = asyncio.get_running_loop()
        job = _SignJob(message, keys, loop.create_future())
        self._waiting.append(job)
        if len(self._waiting) == 1:
            loop.call_soon(self._sign_next)
        return job.result

    def _sign_next(self) -> None:
        """Make one waiting signature, then leave the rest to the next iteration: call_soon from a
        callback runs after the loop has polled its sockets again."""
        if not self._waiting:  # close() took them
            return
        job = self._waiting.popleft()
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._sign_next)
        if job.result.cancelled():
            return
        try:
            # t= is taken when the signature is made: a backlog never backdates it.
            fields = dkim.sign(job.message, job.keys, timestamp=int(self._clock()))
        except Exception as exc:
            job.result.set_exception(exc)
        else:
            job.result.set_result(fields)

    async def keys_for(self, org_id: uuid.UUID, domain: str) -> tuple[dkim.SigningKey, ...]:
        """The active keys that sign the org's mail from `domain` (its own; the owner's for
        `owner_key_org`), from the cache when fresh enough."""
        cache_key = (org_id, domain)
        now = time.monotonic()
        cached = self._cache.get(cache_key)
        if cached is not None and now - cached.fetched_at < self._cache_ttl:
            return cached.keys
        # One lookup per (org, domain) at a time: a batch of deliveries from one sender shares it.
        pending = self._lookups.get(cache_key)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(org_id, domain))
            self._lookups[cache_key] = pending
            pending.add_done_callback(lambda done: self._lookup_done(cache_key, done))
        try:
            return await asyncio.shield(pending)
        except Exception as exc:
            if cached is not None and now - cached.fetched_at < self._stale_ttl:
                log.warning(
                    "DKIM keys for %s: using cached keys, the lookup failed: %s", domain, exc
                )
                return cached.keys
            raise KeysUnavailable(f"cannot read the DKIM keys for {domain}: {exc}") from exc

    def _lookup_done(
        self, cache_key: tuple[uuid.UUID, str], done: asyncio.Future[tuple[dkim.SigningKey, ...]]
    ) -> None:
        self._lookups.pop(cache_key, None)
        if not done.cancelled():
            done.exception()  # the waiters have it; don't let asyncio log it again

    async def _fetch(self, org_id: uuid.UUID, domain: str) -> tuple[dkim.SigningKey, ...]:
        # `domain` is spelled as sender domains are stored (pigeon_mta/domains.py).
        if self._owner_key_org is not None and await self._org_name(org_id) == self._owner_key_org:
            rows = await store_dkim_keys.owner_signing_keys(self._db, domain)
        else:
            rows = await store_dkim_keys.active_signing_keys(self._db, org_id, domain)
        new_rows = [row for row in rows if row.id not in self._loaded]
        if new_rows:
            # OpenSSL checks an RSA key as it loads it: ~50 ms for 2048 bits, ~350 ms for 4096.
            # That happens once per key and process, on a thread: the GIL is handed back to the
            # loop every switch interval, so the other connections wait milliseconds, not that.
            self._loaded.update(await asyncio.to_thread(_load_keys, new_rows))
        keys = tuple(self._loaded[row.id] for row in rows if row.id in self._loaded)
        if len(self._cache) >= self.MAX_CACHED:
            self._cache.clear()
        self._cache[(org_id, domain)] = _CachedKeys(keys, time.monotonic())
        return keys

    def close(self) -> None:
        """Fail signatures still waiting (after the engine has stopped calling, there are none)."""
        while self._waiting:
            job = self._waiting.popleft()
            if not job.result.done():
                job.result.set_exception(RuntimeError("the DKIM signer was closed"))


def _load_keys(
    rows: list[store_dkim_keys.ActiveSigningKey],
) -> dict[uuid.UUID, dkim.SigningKey]:
    """Parse stored keys; a key's private half never changes, so each is parsed once."""
    loaded = {}
    for row in rows:
        try:
            loaded[row.id] = dkim.load_signing_key(
                row.domain,
                row.selector,
                "rsa" if row.algorithm == "rsa" else "ed25519",
                row.private_key,
            )
        except (ValueError, TypeError) as exc:
            # Only a damaged row gets here (keys are made by `dkim keygen`); the others sign.
            log.error("DKIM key %s._domainkey.%s is unusable: %s", row.selector, row.domain, exc)
    return loaded


@dataclass(frozen=True)
class _SignJob:
    message: bytes
    keys: tuple[dkim.SigningKey, ...]
    result: asyncio.Future[bytes]


def _unsigned(message: bytes, reason: str, text: str | None = None) -> Signed:
    """`message` as it is, counted by `reason` and explained by `text` (else the reason's own)."""
    DKIM_UNSIGNED.labels(reason=reason).inc()
    return Signed(message, f"unsigned: {text or _UNSIGNED_TEXT[reason]}")
