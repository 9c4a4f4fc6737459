"""One spelling of a domain for routing, DKIM and the sender-domain table."""

from __future__ import annotations

import pytest

from pigeon_mta import dkim
from pigeon_mta.domains import ascii_domain, domain_spellings
from pigeon_mta.outbound import mx


def test_routing_and_dkim_spell_an_international_domain_alike() -> None:
    assert ascii_domain(" Bücher.Example. ") == "xn--bcher-kva.example"
    assert mx.ascii_domain is dkim.ascii_domain is ascii_domain
    assert dkim.record_name("s1", "Bücher.example") == "s1._domainkey.xn--bcher-kva.example"


def test_spellings_are_as_written_and_in_a_labels() -> None:
    assert domain_spellings("Bücher.Example.") == ["bücher.example", "xn--bcher-kva.example"]
    assert domain_spellings("Example.COM") == ["example.com"]


@pytest.mark.parametrize("bad", ["a" * 64 + ".example", "bad..example"])
def test_a_name_dns_cannot_carry_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="not a valid domain name"):
        ascii_domain(bad)
    with pytest.raises(ValueError):
        domain_spellings(bad)
