"""One spelling of a domain for routing, DKIM, addresses and the sender-domain table."""

from __future__ import annotations

import pytest

from pigeon_mta import dkim
from pigeon_mta.domains import ascii_domain, normalize_domain
from pigeon_mta.outbound import mx


def test_routing_and_dkim_spell_an_international_domain_alike() -> None:
    assert ascii_domain(" Bücher.Example. ") == "xn--bcher-kva.example"
    assert mx.ascii_domain is dkim.ascii_domain is ascii_domain
    assert dkim.record_name("s1", "Bücher.example") == "s1._domainkey.xn--bcher-kva.example"


@pytest.mark.parametrize("bad", ["a" * 64 + ".example", "bad..example"])
def test_a_name_dns_cannot_carry_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="not a valid domain name"):
        ascii_domain(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Example.COM", "example.com"),
        ("münchen.de", "xn--mnchen-3ya.de"),
        ("Bücher.Example", "xn--bcher-kva.example"),
        # IDNA 2008, as resolvers and routing spell it: ß is a letter of its own, not "ss".
        ("faß.de", "xn--fa-hia.de"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("a..b", None),
        ("", None),
        ("example.com.", None),
        (" example.com", None),
        ("exa_mple.com", None),
        ("-bad.example", None),
        ("192.0.2.1", None),
        ("ü" * 64 + ".example", None),
    ],
)
def test_normalize_domain(text: str, expected: str | None) -> None:
    assert normalize_domain(text) == expected


@pytest.mark.parametrize("text", ["Example.COM", "münchen.de", "Bücher.Example", "faß.de"])
def test_a_host_name_is_spelled_as_dns_spells_it(text: str) -> None:
    """The spelling a sender domain is stored in is the one mail to it is routed by."""
    assert normalize_domain(text) == ascii_domain(text)
