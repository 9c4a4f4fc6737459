"""Small pure pieces of the outbound side: wire format, destination policy."""

from __future__ import annotations

import pytest

from pigeon_mta.config import DeliverySettings, DestinationSettings
from pigeon_mta.outbound import limits
from pigeon_mta.outbound.attempt import wire_message
from pigeon_mta.outbound.limits import policy_for
from pigeon_mta.outbound.mx import Hop, Route, ascii_domain


@pytest.mark.parametrize(
    ("body", "wire"),
    [
        (b"a\r\nb\r\n", b"a\r\nb\r\n.\r\n"),
        (b"a\nb", b"a\r\nb\r\n.\r\n"),
        (b".hidden\r\n.\r\n..x\r\n", b"..hidden\r\n..\r\n...x\r\n.\r\n"),
        (b"x\r\n.\r\nend", b"x\r\n..\r\nend\r\n.\r\n"),
    ],
)
def test_wire_message_ends_lines_with_crlf_and_stuffs_dots(body: bytes, wire: bytes) -> None:
    assert wire_message(body) == wire


def route(domain: str, *hosts: str) -> Route:
    return Route(f"mx:{domain}", "mx", tuple(Hop(h, 25) for h in hosts))


def test_policy_defaults_key_on_the_site() -> None:
    delivery = DeliverySettings()
    policy = policy_for(delivery, "example.com", route("example.com", "mx.example.com"))
    assert policy.site == "site:mx.example.com"
    assert (policy.tls, policy.concurrency, policy.rate) == ("opportunistic", 100, 0)
    assert policy.max_messages_per_connection == 100


def test_policy_exact_domain_beats_patterns_and_mx_patterns_group_domains() -> None:
    delivery = DeliverySettings(
        destination={
            "gmail.com": DestinationSettings(concurrency=5),
            "*.google.com": DestinationSettings(concurrency=10, rate=50, tls="verify"),
            "*.com": DestinationSettings(concurrency=2),
        }
    )
    google_mx = ("gmail-smtp-in.l.google.com", "alt1.gmail-smtp-in.l.google.com")
    gmail = policy_for(delivery, "gmail.com", route("gmail.com", *google_mx))
    assert (gmail.site, gmail.concurrency) == ("pattern:gmail.com", 5)
    # A domain pattern is tried before MX patterns.
    hosted = policy_for(delivery, "corp.com", route("corp.com", *google_mx))
    assert hosted.site == "pattern:*.com"
    other = policy_for(delivery, "corp.org", route("corp.org", *google_mx))
    assert (other.site, other.concurrency, other.rate, other.burst, other.tls) == (
        "pattern:*.google.com",
        10,
        50,
        50,
        "verify",
    )


def test_the_relayhost_tls_setting_wins() -> None:
    delivery = DeliverySettings(tls="verify")
    relay = Route("relayhost", "relayhost", (Hop("relay.example", 587),), tls="required")
    assert policy_for(delivery, "x.example", relay).tls == "required"


def test_ascii_domain_uses_idna() -> None:
    assert ascii_domain("Bücher.Example") == "xn--bcher-kva.example"
    with pytest.raises(ValueError):
        ascii_domain("a" * 64 + ".example")


def test_idle_gates_are_forgotten_when_there_are_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_IDLE_GATES", 2)
    gates = limits.Gates()
    delivery = DeliverySettings()
    busy = gates.get(policy_for(delivery, "a.example", route("a.example", "mx.a.example")))
    busy.in_flight = 1
    gates.get(policy_for(delivery, "b.example", route("b.example", "mx.b.example")))
    gates.get(policy_for(delivery, "c.example", route("c.example", "mx.c.example")))
    assert sorted(gates._gates) == ["site:mx.a.example", "site:mx.c.example"]


def test_domains_whose_mx_records_name_the_same_hosts_share_one_site() -> None:
    delivery = DeliverySettings()
    google = ("aspmx.l.google.com", "alt1.aspmx.l.google.com", "alt2.aspmx.l.google.com")
    # Another order (preferences, shuffling) and another spelling are the same hosts.
    one = policy_for(delivery, "shop.example", route("shop.example", *google))
    two = policy_for(
        delivery, "corp.example", route("corp.example", *reversed([h.upper() for h in google]))
    )
    assert (
        one.site
        == two.site
        == ("site:alt1.aspmx.l.google.com,alt2.aspmx.l.google.com,aspmx.l.google.com")
    )
    # Another set of hosts is another site, and a static route or the relayhost is its own.
    assert policy_for(delivery, "x.example", route("x.example", google[0])).site != one.site
    relay = Route("relayhost", "relayhost", (Hop("relay.example", 587),))
    assert policy_for(delivery, "x.example", relay).site == "relayhost"
    static = Route("route:[127.0.0.2]:2525", "route", (Hop("127.0.0.2", 2525),))
    assert policy_for(delivery, "x.example", static).site == "route:[127.0.0.2]:2525"


def test_a_site_of_five_long_host_names_has_a_bounded_key() -> None:
    hosts = [f"{'m' * 60}.{i}.{'x' * 60}.example" for i in range(5)]
    key = policy_for(DeliverySettings(), "x.example", route("x.example", *hosts)).site
    assert len(key) <= 5 + 200
    shuffled = policy_for(DeliverySettings(), "y.example", route("y.example", *hosts[::-1])).site
    assert key == shuffled
    other = policy_for(DeliverySettings(), "z.example", route("z.example", *hosts[:4])).site
    assert other != key


def test_a_sites_budget_key_is_per_source_and_the_default_sources_is_unchanged() -> None:
    """The budget of a (source, site): the default source's keys are as they always were, so
    budgets, suspensions and site queues written before keep their meaning; another source's
    site is another budget, and each key reads back as its pair."""
    from pigeon_mta.outbound.limits import DestinationPolicy
    from pigeon_mta.store.budgets import DEFAULT_SOURCE, site_budget_key, source_and_site

    site = "site:mx1.example.net,mx2.example.net"
    policy = DestinationPolicy(site, "opportunistic", 10, 0.0, 0, 0, 100)
    assert policy.budget_key == "destination:" + site == site_budget_key(DEFAULT_SOURCE, site)
    other = DestinationPolicy(site, "opportunistic", 10, 0.0, 0, 0, 100, source="pool-b")
    assert other.budget_key != policy.budget_key
    for key, pair in (
        (policy.budget_key, (DEFAULT_SOURCE, site)),
        (other.budget_key, ("pool-b", site)),
        ("destination:route:127.0.0.2:2525", (DEFAULT_SOURCE, "route:127.0.0.2:2525")),
    ):
        assert source_and_site(key) == pair
