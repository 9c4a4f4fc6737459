"""The MX resolver against a real DNS server on loopback: order, shuffling, limits, cache, families.

Router (dnspython async resolver) --UDP/TCP--> DnsServer 127.0.0.1:<port>
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import dns.asyncresolver
import dns.resolver
import pytest

from pigeon_mta.config import DnsSettings, Duration, Settings
from pigeon_mta.outbound.mx import Route, RouteFailure, Router, make_resolver
from tests.peers.dns_server import DnsServer


@pytest.fixture
async def dns_server() -> AsyncIterator[DnsServer]:
    server = await DnsServer().start()
    try:
        yield server
    finally:
        await server.close()


def router_for(server: DnsServer, **delivery: object) -> Router:
    base = Settings(dns=DnsSettings(nameservers=(server.nameserver,), timeout=Duration(1)))
    settings = dataclasses.replace(base, delivery=dataclasses.replace(base.delivery, **delivery))
    return Router(settings)


async def test_equal_preferences_are_shuffled_and_better_preferences_come_first(
    dns_server: DnsServer,
) -> None:
    dns_server.mx(
        "eq.test", (20, "c.eq.test"), (10, "a.eq.test"), (10, "b.eq.test"), (10, "d.eq.test")
    )
    router = router_for(dns_server)
    orders = set()
    for _ in range(40):
        route = await router.route("eq.test")
        assert isinstance(route, Route)
        assert route.hops[-1].host == "c.eq.test"
        orders.add(route.host_names[:3])
    assert len(orders) > 1  # 40 identical orders of 3 equal hosts: chance (1/6)**39
    assert dns_server.asked("eq.test", "MX") == 1  # the rest came from the cache


async def test_at_most_five_mx_hosts_are_tried(dns_server: DnsServer) -> None:
    dns_server.mx("many.test", *((i, f"mx{i}.many.test") for i in range(1, 9)))
    route = await router_for(dns_server).route("many.test")
    assert isinstance(route, Route)
    assert route.host_names == tuple(f"mx{i}.many.test" for i in range(1, 6))


async def test_answers_are_cached_for_their_ttl(dns_server: DnsServer) -> None:
    dns_server.mx("short.test", (10, "mx.short.test"), ttl=1)
    router = router_for(dns_server)
    await router.route("short.test")
    await router.route("short.test")
    assert dns_server.asked("short.test", "MX") == 1
    await asyncio.sleep(1.5)
    await router.route("short.test")
    assert dns_server.asked("short.test", "MX") == 2


async def test_negative_answers_are_cached_too(dns_server: DnsServer) -> None:
    router = router_for(dns_server)
    for _ in range(3):
        failure = await router.route("gone.test")
        assert isinstance(failure, RouteFailure) and failure.reply.enhanced_code == "5.1.2"
    assert dns_server.asked("gone.test", "MX") == 1


@pytest.mark.parametrize(
    ("preference", "expected"),
    [
        ("ipv4", ["127.0.0.2", "::1"]),
        ("ipv6", ["::1", "127.0.0.2"]),
        ("ipv4-only", ["127.0.0.2"]),
        ("ipv6-only", ["::1"]),
    ],
)
async def test_address_family_preference(
    dns_server: DnsServer, preference: str, expected: list[str]
) -> None:
    dns_server.a("dual.test", "127.0.0.2")
    dns_server.aaaa("dual.test", "::1")
    assert await router_for(dns_server, ip_preference=preference).addresses("dual.test") == expected


async def test_a_host_without_addresses_of_the_allowed_family_is_permanent(
    dns_server: DnsServer,
) -> None:
    dns_server.a("v4.test", "127.0.0.2")
    failure = await router_for(dns_server, ip_preference="ipv6-only").addresses("v4.test")
    assert isinstance(failure, RouteFailure) and failure.reply.enhanced_code == "5.1.2"


async def test_a_nameserver_that_never_answers_is_a_temporary_failure(
    dns_server: DnsServer,
) -> None:
    dns_server.hang("slow.test")
    failure = await router_for(dns_server).route("slow.test")
    assert isinstance(failure, RouteFailure)
    assert failure.reply.enhanced_code == "4.4.3" and "timed out" in failure.reply.text


async def test_the_test_server_answers_over_tcp_too(dns_server: DnsServer) -> None:
    dns_server.mx("tcp.test", (10, "mx.tcp.test"))
    settings = Settings(dns=DnsSettings(nameservers=(dns_server.nameserver,)))
    resolver: dns.asyncresolver.Resolver = make_resolver(settings)
    answer = await resolver.resolve("tcp.test", "MX", tcp=True)
    assert [r.exchange.to_text() for r in answer] == ["mx.tcp.test."]


async def test_a_route_once_answered_asks_the_resolver_nothing_until_it_expires(
    dns_server: DnsServer,
) -> None:
    # Every message asks for its route: after the first, the MX hosts and their addresses come
    # from the router's memory, without a resolution (even one dnspython's cache would answer).
    dns_server.mx("busy.test", (10, "mx.busy.test"), ttl=1)
    dns_server.a("mx.busy.test", "127.0.0.2", ttl=1)
    settings = Settings(dns=DnsSettings(nameservers=(dns_server.nameserver,), timeout=Duration(1)))
    resolver = make_resolver(settings)
    router = Router(settings, resolver)
    cache = resolver.cache
    assert isinstance(cache, dns.resolver.LRUCache)

    async def deliver_one() -> list[str]:
        route = await router.route("busy.test")
        assert isinstance(route, Route)
        addresses = await router.addresses(route.hops[0].host)
        assert isinstance(addresses, list)
        return addresses

    assert await deliver_one() == ["127.0.0.2"]
    asked = (cache.hits(), cache.misses())
    for _ in range(20):
        assert await deliver_one() == ["127.0.0.2"]
    assert (cache.hits(), cache.misses()) == asked
    await asyncio.sleep(1.5)
    assert await deliver_one() == ["127.0.0.2"]
    assert dns_server.asked("busy.test", "MX") == 2
    assert dns_server.asked("mx.busy.test", "A") == 2


async def test_a_changed_address_is_used_once_the_old_answer_expires(dns_server: DnsServer) -> None:
    dns_server.a("moved.test", "127.0.0.2", ttl=1)
    router = router_for(dns_server)
    assert await router.addresses("moved.test") == ["127.0.0.2"]
    dns_server.a("moved.test", "127.0.0.3", ttl=1)
    assert await router.addresses("moved.test") == ["127.0.0.2"]  # within the TTL
    await asyncio.sleep(1.5)
    assert await router.addresses("moved.test") == ["127.0.0.3"]
