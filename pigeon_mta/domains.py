"""Domain names as DNS carries them: the one A-label spelling that routing, DKIM and the sender
domains use, so that a name with non-ASCII labels is routed, signed (d=) and looked up alike."""

from __future__ import annotations

import functools

import dns.exception
import dns.name


@functools.lru_cache(maxsize=4096)  # called per message and recipient with few distinct names
def ascii_domain(domain: str) -> str:
    """Lower case, no final dot, IDNA A-labels; raises ValueError for a name DNS cannot carry."""
    name = domain.strip().rstrip(".").lower()
    try:
        return dns.name.from_text(name).to_text(omit_final_dot=True)
    except (dns.exception.DNSException, UnicodeError) as exc:
        raise ValueError(f"{domain!r} is not a valid domain name: {exc}") from None


def domain_spellings(domain: str) -> list[str]:
    """The ways a domain may have been stored: as written (lower case, no final dot) and in
    A-labels (the same string for an ASCII name). Raises ValueError like `ascii_domain`."""
    return sorted({domain.strip().rstrip(".").lower(), ascii_domain(domain)})
