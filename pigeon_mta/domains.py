"""Domain names in the one spelling that pigeon-mta stores, compares, routes and signs (d=): lower
case, IDNA A-labels, no final dot. Every name that is written (sender domains, DKIM records) or
looked up (a From: domain, a recipient's domain) is spelled here, so one string match finds it.

The A-labels are dnspython's (IDNA 2008 with the UTS 46 mapping, what resolvers use today):
"faß.de" is xn--fa-hia.de, a domain of its own, not "fass.de" as IDNA 2003 would have it.
"""

from __future__ import annotations

import functools
import re

import dns.exception
import dns.name

from pigeon_mta.plain import is_digits

# A host name's label: letters, digits and inner hyphens, 63 at most (RFC 1123 2.1, RFC 1035 2.3.1).
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")


@functools.lru_cache(maxsize=4096)  # called per message and recipient with few distinct names
def ascii_domain(domain: str) -> str:
    """Lower case, no final dot, IDNA A-labels; raises ValueError for a name DNS cannot carry."""
    name = domain.strip().rstrip(".").lower()
    try:
        return dns.name.from_text(name).to_text(omit_final_dot=True)
    except (dns.exception.DNSException, UnicodeError) as exc:
        raise ValueError(f"{domain!r} is not a valid domain name: {exc}") from None


def routing_domain(domain: str) -> str:
    """A recipient's domain as it is grouped, routed and limited: `ascii_domain`, or lower case
    alone for a name DNS cannot carry (its routing then fails and says why)."""
    try:
        return ascii_domain(domain)
    except ValueError:
        return domain.lower()


def normalize_domain(text: str) -> str | None:
    """A host name as written in an address or given to a command, in the spelling of
    `ascii_domain`; None when it is not a host name (a final dot, an empty or non-LDH label, an
    all-numeric top label, more than 253 octets). Sender domains are stored in this form."""
    if not text or text.endswith(".") or len(text) > 253 or text.strip() != text:
        return None
    if text.isascii():
        name = text.lower()  # ascii_domain would read backslash escapes; an LDH name has none
    else:
        try:
            name = ascii_domain(text)
        except ValueError:
            return None
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels):
        return None
    if is_digits(labels[-1]):
        return None  # a dotted IP address is not a domain (RFC 1123 2.1)
    return name
