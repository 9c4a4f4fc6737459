"""Why a reply did not deliver: the categories and the ordered table of rules that name them.

The reasons live in one ordered table, first match wins (`classify.classify_reply` reads it).
Text comes first because it is the most specific evidence and because big providers bend the
enhanced codes (Microsoft answers "recipient not found" with 5.1.10, which RFC 7505 gives to null
MX; Gmail uses 4.7.0 for most things). Then the enhanced code (RFC 3463 and the IANA registry),
then the basic code (RFC 5321 section 4.2). Every rule has a name, recorded beside the category on
the attempt, so a surprising category can be traced to the rule that chose it. Every pattern runs
in time linear in what it reads (no unbounded repetition: tests/unit/test_classify_hostile.py
checks each).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import NamedTuple


class Category(enum.StrEnum):
    INVALID_RECIPIENT = "invalid-recipient"  # no such mailbox, or disabled for good
    BAD_DOMAIN = "bad-domain"  # the recipient's domain does not exist or takes no mail
    MAILBOX_FULL = "mailbox-full"
    MESSAGE_TOO_LARGE = "message-too-large"
    SPAM_BLOCK = "spam-block"  # the content was judged spam, phishing or malware
    BLOCKLISTED = "blocklisted"  # our IP or domain is on a block list / has a bad reputation
    POLICY = "policy"  # refused by a local policy: relaying, sender address, restrictions
    RATE_LIMITED = "rate-limited"  # too much, too fast: volume, connections, recipients
    GREYLISTED = "greylisted"
    AUTHENTICATION = "authentication"  # SPF, DKIM, DMARC, reverse DNS, SMTP AUTH
    TLS = "tls"
    DNS = "dns"  # our own lookup of the destination failed (temporarily)
    CONNECTION = "connection"  # refused, reset, timed out, closed
    PROTOCOL = "protocol"  # the SMTP conversation went wrong (syntax, sequence)
    EXPIRED = "expired"  # delivery.max_age passed
    SUPPRESSED = "suppressed"  # not attempted: the address is on the suppression list
    OTHER = "other"


# A hard bounce in one of these categories puts the address on the org's suppression list: mail to
# it cannot succeed later either. Everything else may change (a full mailbox gets emptied, a block
# list entry expires), so it is not suppressed.
SUPPRESSING_CATEGORIES = frozenset({Category.INVALID_RECIPIENT, Category.BAD_DOMAIN})


class Classification(NamedTuple):
    category: Category
    rule: str


@dataclass(frozen=True)
class Rule:
    """One line of the table: every condition given must hold."""

    name: str
    category: Category
    text: re.Pattern[str] | None = None  # searched in the reply text (lower case, one line)
    enhanced: re.Pattern[str] | None = None  # full match on the enhanced code, e.g. 5.1.1
    code: re.Pattern[str] | None = None  # full match on the three-digit code; 000 = local failure

    def matches(self, code: str, enhanced: str, text: str) -> bool:
        return (
            (self.text is None or self.text.search(text) is not None)
            and (self.enhanced is None or self.enhanced.fullmatch(enhanced) is not None)
            and (self.code is None or self.code.fullmatch(code) is not None)
        )


def rule(
    name: str,
    category: Category,
    *,
    text: str | None = None,
    enhanced: str | None = None,
    code: str | None = None,
) -> Rule:
    """A rule; in `enhanced`, "x" stands for any class (x.1.1 matches 4.1.1 and 5.1.1)."""
    return Rule(
        name=name,
        category=category,
        text=re.compile(text) if text else None,
        enhanced=re.compile(enhanced.replace(".", r"\.").replace("x", "[245]"))
        if enhanced
        else None,
        code=re.compile(code) if code else None,
    )


C = Category

RULES: tuple[Rule, ...] = (
    # ---- a local failure that recurred on every attempt (outbound/outcome.py): pigeon-mta's
    # own trouble with the message, never about the recipient, whatever the error text says
    rule("local-failure-repeated", C.OTHER, code="000", enhanced="5.3.0"),
    # ---- about our own sender address, never about the recipient: must not suppress anyone
    # (X.1.7/X.1.8 bad sender address, X.7.27 sender's domain has a null MX).
    rule("sender-address-code", C.POLICY, enhanced="x.(1.7|1.8|7.27)"),
    rule(
        "sender-address-text",
        C.POLICY,
        text=r"sender address (rejected|has null mx)|sender (domain|address) (unknown|not found|"
        r"invalid|does not exist)|sender (rejected|denied)|from address rejected",
    ),
    # ---- local decisions and failures (code 000: nothing was said by a server)
    rule("suppression-list", C.SUPPRESSED, code="000", text=r"suppression list|suppressed"),
    rule(
        "queue-expired",
        C.EXPIRED,
        text=r"expired after|delivery time expired|message expired|too long in the queue",
    ),
    rule("null-mx", C.BAD_DOMAIN, text=r"null mx"),
    rule(
        "local-nxdomain",
        C.BAD_DOMAIN,
        code="000",
        text=r"nxdomain|does not exist|no such domain|non-existent domain|domain not found",
    ),
    rule(
        "local-dns",
        C.DNS,
        code="000",
        text=r"\bdns\b|servfail|name resolution|resolv|no mx|no address|nameserver|lookup|"
        r"no answer",
    ),
    # ---- greylisting says "come back later", nothing more
    rule("greylisted", C.GREYLISTED, text=r"gr[ae]y-?list"),
    rule("try-later-4.7.1", C.GREYLISTED, code="4..", enhanced="4.7.1", text=r"try again later"),
    # ---- too much, too fast (Gmail 4.7.28 "unusual rate", Yahoo TSS04, Microsoft "server busy")
    rule(
        "rate-limit-text",
        C.RATE_LIMITED,
        text=r"rate.?limit|too many (messages|connections|recipients|mails|emails|concurrent|"
        r"sessions)|unusual rate|receiving mail (at a rate|too quickly)|unexpected volume|"
        r"throttl|server busy|temporarily deferred|slow down|too much mail|sending (rate|quota|"
        r"limit)|sent too many|exceeded [^.;]{0,40}(rate|sending)",
    ),
    # ---- TLS and connection troubles, whatever the code
    rule(
        "tls-text",
        C.TLS,
        text=r"\b(tls|ssl|starttls)\b|certificate|handshake|encryption (needed|required)",
    ),
    rule(
        "connection-text",
        C.CONNECTION,
        text=r"connection (refused|reset|timed out|closed|lost|dropped|aborted)|timed out|"
        r"timeout|network (is )?unreachable|no route to host|host unreachable|unexpected eof|"
        r"disconnected|broken pipe|lost connection",
    ),
    # ---- sender authentication (SPF/DKIM/DMARC, reverse DNS; Gmail 5.7.26, Yahoo 5.7.9)
    rule(
        "authentication-text",
        C.AUTHENTICATION,
        text=r"\bdmarc\b|\bspf\b|\bdkim\b|unauthenticated|not authenticated|authentication "
        r"(required|failed|check)|ptr record|reverse (dns|hostname|lookup)|"
        r"cannot find your (reverse )?hostname|ipv6 sending guidelines",
    ),
    # ---- the recipient's mailbox is full (before "too large": "mailbox size limit exceeded")
    rule(
        "mailbox-full-text",
        C.MAILBOX_FULL,
        text=r"mailbox (is )?full|over ?quota|quota ?exceeded|exceeded (its|the|their)? ?quota|"
        r"quota|out of storage|inbox is full|storage (allocation|space)|mailbox size limit|"
        r"full mailbox|insufficient (disk )?space",
    ),
    rule(
        "message-too-large-text",
        C.MESSAGE_TOO_LARGE,
        text=r"message (size|length|is too)|too (big|large)|size limit|maximum (message )?size|"
        r"message size|size exceeds",
    ),
    # ---- our reputation (Spamhaus and friends, Microsoft S3150 / 5.7.606, Yahoo TSS09)
    rule(
        "blocklisted-text",
        C.BLOCKLISTED,
        text=r"blocked using|block ?list|black ?list|deny ?list|spamhaus|spamcop|barracuda|sorbs|"
        r"\brbl\b|dnsbl|listed (at|in|on|by)|reputation|banned sending ip|permanently deferred|"
        r"\btss09\b|sender\.office\.com",
    ),
    rule(
        "spam-text",
        C.SPAM_BLOCK,
        text=r"spam|unsolicited|junk|phish|virus|malware|suspicious|security issue|"
        r"content (rejected|filter|policy)|message content|bulk mail",
    ),
    # ---- the recipient does not exist or is disabled
    rule(
        "directory-block",  # Microsoft 365 directory-based edge blocking: unknown recipient
        C.INVALID_RECIPIENT,
        text=r"recipient address rejected: access denied|recipientnotfound",
    ),
    rule(
        "disabled-mailbox",
        C.INVALID_RECIPIENT,
        code="5..",
        text=r"(mailbox|account|user) (is |has been )?(disabled|inactive|suspended|deactivated|"
        r"closed|blocked)|(account|address) (is )?no longer (active|in use|valid)|"
        r"that you tried to reach is (disabled|inactive)",
    ),
    rule(
        "unknown-mailbox",
        C.INVALID_RECIPIENT,
        text=r"user unknown|unknown (user|recipient|mailbox|address)|no such (user|mailbox|"
        r"recipient|address|account)|(user|recipient|mailbox|address) not found|"
        r"recipient unknown|nosuchuser|not a valid (mailbox|recipient|user|address)|"
        r"invalid (recipient|mailbox)|(recipient|mailbox) (address )?(is )?invalid|"
        r"(account|mailbox|address|user) (does not|doesn't) exist|does not exist here|"
        r"doesn't have an? [a-z0-9.-]{1,64} account|unrouteable address|no mailbox here|"
        r"address (is )?unknown|bad destination mailbox|undeliverable address",
    ),
    rule("mailbox-unavailable", C.INVALID_RECIPIENT, code="5..", text=r"mailbox unavailable"),
    rule(
        "bad-domain-text",
        C.BAD_DOMAIN,
        text=r"domain (not found|does not exist|doesn't exist|unknown|is invalid|not valid)|"
        r"(unknown|no such|invalid|unrouteable) domain|host (not found|unknown)|"
        r"bad destination system|does not accept mail",
    ),
    # ---- refused by policy
    rule(
        "relay-denied",
        C.POLICY,
        text=r"relay(ing)? (access )?(denied|not permitted|prohibited)|not permitted to relay|"
        r"unable to relay|rcpthosts",
    ),
    rule(
        "policy-text",
        C.POLICY,
        text=r"policy|not authori[sz]ed|not allowed|access denied|prohibited|"
        r"administrative(ly)? prohibit|restricted|client host rejected",
    ),
    # ---- no helpful words: the enhanced code (RFC 3463, IANA registry)
    rule("enhanced-bad-mailbox", C.INVALID_RECIPIENT, enhanced="x.1.(1|3|6)"),
    rule("enhanced-bad-domain", C.BAD_DOMAIN, enhanced="(x.1.2|x.1.10|5.4.4)"),
    rule("enhanced-mailbox-disabled", C.INVALID_RECIPIENT, enhanced="5.2.1"),
    rule("enhanced-mailbox-full", C.MAILBOX_FULL, enhanced="x.2.2"),
    rule("enhanced-too-large", C.MESSAGE_TOO_LARGE, enhanced="x.(2.3|3.4)"),
    rule("enhanced-mail-system", C.OTHER, enhanced="x.3.(0|1|2|3|5)"),  # the receiver's trouble
    rule("enhanced-no-answer", C.CONNECTION, enhanced="x.4.(1|2)"),
    rule("enhanced-routing", C.DNS, enhanced="x.4.(3|4)"),
    rule("enhanced-congestion", C.RATE_LIMITED, enhanced="x.4.5"),
    rule("enhanced-expired", C.EXPIRED, enhanced="x.4.7"),
    rule("enhanced-protocol", C.PROTOCOL, enhanced="x.5.[0-9]{1,3}"),
    rule("enhanced-authentication", C.AUTHENTICATION, enhanced="x.7.(8|2[0-6])"),
    rule("enhanced-tls", C.TLS, enhanced="x.7.(4|5|6|10|11)"),
    rule("enhanced-mail-flood", C.RATE_LIMITED, enhanced="x.7.28"),
    rule("enhanced-blocked-ip", C.BLOCKLISTED, enhanced="5.7.(6[0-4][0-9])"),  # Microsoft
    # Throttling without telling words: Gmail's "421 4.7.0 Try again later, closing
    # connection", Microsoft's 4.7.650-652 ("temporarily rate limited due to IP reputation").
    rule("throttle-421-4.7.0", C.RATE_LIMITED, code="421", enhanced="4.7.0"),
    rule("enhanced-rate-limited-ip", C.RATE_LIMITED, enhanced="4.7.65[0-2]"),
    rule("enhanced-security", C.POLICY, enhanced="x.7.[0-9]{1,3}"),
    # ---- only the basic code (RFC 5321 section 4.2.2)
    rule("code-closing", C.CONNECTION, code="421"),
    rule("code-storage", C.MAILBOX_FULL, code="552"),
    rule("code-not-local", C.INVALID_RECIPIENT, code="551"),
    rule("code-syntax", C.PROTOCOL, code="50[0-4]"),
    rule("code-authentication", C.AUTHENTICATION, code="53[0-5]"),
    rule("code-tls", C.TLS, code="538"),
    rule("code-temporary", C.OTHER, code="4.."),
    rule("code-permanent", C.OTHER, code="5.."),
)
