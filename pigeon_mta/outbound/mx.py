"""Routing: where mail for a domain goes — static routes, the relayhost, else MX through DNS.

Static routes and the relayhost override DNS. Otherwise the domain (IDNA-encoded first) is looked
up: MX hosts in preference order with equal preferences shuffled, at most five; no MX means the
domain itself (implicit MX, RFC 5321 5.1); a null MX (RFC 7505) and NXDOMAIN are permanent; SERVFAIL
and timeouts are temporary. Answers, negative ones included, are cached for their TTL by dnspython's
cache. Host addresses come from A and AAAA in the configured family order.

What a domain's MX answer and a host's address answers came to is also kept here until the first of
those answers expires (`_Remembered`): every message asks for its route, and even an answer from
dnspython's cache costs a resolution, name parsing and, for a negative answer, an exception whose
text is formatted at once: about 16% more worker CPU per message than the relayhost route, where
the memory leaves it even (bench/README.md, "MX routing against relayhost").
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from pigeon_mta.config import IpPreference, Settings, TlsPolicy
from pigeon_mta.config_values import nameserver_address, route_target
from pigeon_mta.domains import ascii_domain, routing_domain
from pigeon_mta.model import Reply

log = logging.getLogger(__name__)

# RFC 5321 5.1 leaves the number of MX hosts to try open; five is what Postfix tries by default,
# enough for real redundancy without letting one domain hold a delivery for long.
MAX_MX_HOSTS = 5
# Characters of a site's name (its MX host names) kept whole.
MAX_SITE_NAME = 200

RouteKind = Literal["mx", "implicit-mx", "route", "relayhost"]
# A domain's MX hosts as (preference, host name), before shuffling; None: no MX records (implicit MX).
MxRecords = tuple[tuple[int, str], ...] | None
T = TypeVar("T")


@dataclass(frozen=True)
class Hop:
    """One host to try: a name (or an IP literal) and a port."""

    host: str
    port: int
    preference: int = 0


@dataclass(frozen=True)
class Route:
    """Where a domain's mail goes: hosts to try in order, and how to talk to them."""

    destination: str  # groups mail that goes to the same place: "mx:example.com", "relayhost", ...
    kind: RouteKind
    hops: tuple[Hop, ...]
    tls: TlsPolicy | None = None  # set for the relayhost; else the destination policy decides
    username: str = ""
    password: str = ""

    @property
    def host_names(self) -> tuple[str, ...]:
        return tuple(h.host for h in self.hops)

    @property
    def site(self) -> str:
        """The site that receives this route's mail, which traffic is shaped by: for MX routes
        the set of MX host names (every domain Google hosts shares one site, whatever the order
        or preferences of its records), for a static route or the relayhost its destination."""
        if self.kind not in ("mx", "implicit-mx"):
            return self.destination
        return site_of(self.host_names)


def site_of(host_names: Iterable[str]) -> str:
    """The site of a set of MX host names, in any order: "site:" and the sorted names."""
    name = ",".join(sorted({host.lower() for host in host_names}))
    if len(name) > MAX_SITE_NAME:
        # Five long host names: a digest keeps the key (and the log line) bounded.
        digest = hashlib.sha256(name.encode()).hexdigest()[:32]
        name = f"{name[: MAX_SITE_NAME - 34]}~{digest}"
    return f"site:{name}"


@dataclass(frozen=True)
class RouteFailure:
    """No route: a local finding (code 0) whose enhanced code says temporary (4.x) or not (5.x)."""

    reply: Reply


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Remembered(Generic[T]):
    """Values built from DNS answers, each kept until the first of its answers expires (wall
    clock, as dnspython's `Answer.expiration`); at most `size`, the oldest dropped first."""

    def __init__(self, size: int) -> None:
        self._size = max(1, size)
        self._entries: dict[str, tuple[float, T]] = {}

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= time.time():
            del self._entries[key]
            return None
        return entry[1]

    def put(self, key: str, value: T, expires: float) -> None:
        if key not in self._entries and len(self._entries) >= self._size:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (expires, value)


def make_resolver(settings: Settings) -> dns.asyncresolver.Resolver:
    """dnspython's async resolver: the configured nameservers (or the system's), with a TTL cache."""
    if settings.dns.nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(addr.host, addr.port)
            for addr in map(nameserver_address, settings.dns.nameservers)
        ]
    else:
        resolver = dns.asyncresolver.Resolver()
    resolver.cache = dns.resolver.LRUCache(max(1, settings.dns.cache_size))
    resolver.lifetime = settings.dns.timeout
    resolver.timeout = min(settings.dns.timeout, 2.0)  # per nameserver try, before the next
    return resolver


class Router:
    def __init__(
        self,
        settings: Settings,
        resolver: dns.asyncresolver.Resolver | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._delivery = settings.delivery
        self._resolver = resolver or make_resolver(settings)
        self._rng = rng or random.Random()
        self._timeout = settings.dns.timeout
        self._preference: IpPreference = settings.delivery.ip_preference
        self._mx: _Remembered[tuple[str, MxRecords]] = _Remembered(settings.dns.cache_size)
        self._addresses: _Remembered[tuple[str, ...]] = _Remembered(settings.dns.cache_size)
        self._routes = {
            self._normalize(domain): route_target(target, default_port=25)
            for domain, target in settings.delivery.routes.items()
        }
        self._relayhost = (
            route_target(settings.delivery.relayhost, default_port=25)
            if settings.delivery.relayhost
            else None
        )

    @staticmethod
    def _normalize(domain: str) -> str:
        return routing_domain(domain)  # cached: ascii_domain keeps the last 4,096 names

    def destination(self, domain: str) -> str:
        """Where a domain's mail goes: recipients of one message at domains that share a static
        route or the relayhost travel in one transaction."""
        route = self.static_route(domain)
        return route.destination if route else f"mx:{domain}"

    def static_route(self, domain: str) -> Route | None:
        """The route given by config for `domain` (no DNS needed), if any."""
        target = self._routes.get(self._normalize(domain))
        if target is not None:
            return Route(
                destination=f"route:{target}",
                kind="route",
                hops=(Hop(target.host, target.port),),
            )
        if self._relayhost is not None:
            return Route(
                destination="relayhost",
                kind="relayhost",
                hops=(Hop(self._relayhost.host, self._relayhost.port),),
                tls=self._delivery.relayhost_tls,
                username=self._delivery.relayhost_username,
                password=self._delivery.relayhost_password,
            )
        return None

    async def route(self, domain: str) -> Route | RouteFailure:
        """Where mail for `domain` goes: static route, relayhost, or its MX hosts."""
        static = self.static_route(domain)
        if static is not None:
            return static
        if domain.startswith("[") and domain.endswith("]"):
            # An address literal (user@[192.0.2.1], user@[IPv6:2001:db8::1]) names the host.
            literal = domain[1:-1].removeprefix("IPv6:").removeprefix("ipv6:")
            if not is_ip_literal(literal):
                return RouteFailure(Reply(0, "5.1.2", f"{domain} is not a valid address literal"))
            return Route(f"mx:{domain}", "implicit-mx", (Hop(literal, self._delivery.port),))
        known = self._mx.get(domain)
        if known is None:
            found = await self._lookup_mx(domain)
            if isinstance(found, RouteFailure):
                return found
            known = found
        name, records = known
        if records is None:
            return await self._implicit_mx(name)
        # Equal preferences are shuffled (RFC 5321 5.1) to spread load over peer hosts.
        real = list(records)
        self._rng.shuffle(real)
        real.sort(key=lambda item: item[0])
        hops = tuple(Hop(host, self._delivery.port, p) for p, host in real[:MAX_MX_HOSTS])
        return Route(f"mx:{name}", "mx", hops)

    async def _lookup_mx(self, domain: str) -> tuple[str, MxRecords] | RouteFailure:
        """The domain's A-label name and its MX records, remembered for the answer's TTL."""
        try:
            name = ascii_domain(domain)
        except ValueError as exc:
            return RouteFailure(Reply(0, "5.1.2", str(exc)))
        try:
            answer = await self._resolver.resolve(
                name, "MX", search=False, lifetime=self._timeout, raise_on_no_answer=False
            )
        except dns.resolver.NXDOMAIN:
            return RouteFailure(Reply(0, "5.1.2", f"domain {name} does not exist (NXDOMAIN)"))
        except dns.exception.DNSException as exc:
            return RouteFailure(
                Reply(0, "4.4.3", f"MX lookup for {name} failed: {_dns_error(exc)}")
            )
        if answer.rrset is None:
            self._mx.put(domain, (name, None), answer.expiration)
            return name, None
        records = [(r.preference, r.exchange) for r in answer]
        real = tuple(
            (p, x.to_text(omit_final_dot=True).lower()) for p, x in records if x != dns.name.root
        )
        if not real:
            # RFC 7505: a null MX says the domain accepts no mail at all.
            return RouteFailure(
                Reply(0, "5.1.10", f"domain {name} accepts no mail (null MX, RFC 7505)")
            )
        self._mx.put(domain, (name, real), answer.expiration)
        return name, real

    async def _implicit_mx(self, name: str) -> Route | RouteFailure:
        # RFC 5321 5.1: with no MX records the domain itself is the host, if it has an address.
        found = await self.addresses(name)
        if isinstance(found, RouteFailure):
            return found
        return Route(f"mx:{name}", "implicit-mx", (Hop(name, self._delivery.port),))

    async def addresses(self, host: str) -> list[str] | RouteFailure:
        """The IP addresses of `host` in the configured family order."""
        known = self._addresses.get(host)
        if known is not None:
            return list(known)
        if is_ip_literal(host):
            return [host]
        families: list[str] = {
            "ipv4": ["A", "AAAA"],
            "ipv6": ["AAAA", "A"],
            "ipv4-only": ["A"],
            "ipv6-only": ["AAAA"],
        }[self._preference]
        answers = await asyncio.gather(*(self._lookup(host, rdtype) for rdtype in families))
        found: list[str] = []
        errors: list[str] = []
        expires: list[float] = []
        for result, expiration in answers:
            if isinstance(result, list):
                found.extend(result)
            elif isinstance(result, str):
                errors.append(result)
            if expiration is not None:
                expires.append(expiration)
        if found:
            if len(expires) == len(answers):  # every family answered, with a TTL
                self._addresses.put(host, tuple(found), min(expires))
            return found
        if errors:
            return RouteFailure(Reply(0, "4.4.3", f"address lookup for {host} failed: {errors[0]}"))
        return RouteFailure(Reply(0, "5.1.2", f"host {host} has no {' or '.join(families)} record"))

    async def _lookup(self, host: str, rdtype: str) -> tuple[list[str] | str | None, float | None]:
        """Addresses; None when the name has none of this type; an error text when DNS failed.
        With it, when the answer expires (None when there was no answer to keep)."""
        try:
            answer = await self._resolver.resolve(
                host, rdtype, search=False, lifetime=self._timeout, raise_on_no_answer=False
            )
        except dns.resolver.NXDOMAIN:
            return None, None
        except dns.exception.DNSException as exc:
            return _dns_error(exc), None
        if answer.rrset is None:
            return None, answer.expiration
        return [r.address for r in answer], answer.expiration


def _dns_error(exc: dns.exception.DNSException) -> str:
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or refused)"
    if isinstance(exc, dns.exception.Timeout):
        return "timed out"
    return str(exc) or type(exc).__name__
