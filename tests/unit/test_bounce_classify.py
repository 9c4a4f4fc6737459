"""Bounce categories: real replies from big providers and common MTAs, each with its category."""

from __future__ import annotations

import pytest

from pigeon_mta.model import Reply
from pigeon_mta.outbound.categories import RULES, SUPPRESSING_CATEGORIES, Category
from pigeon_mta.outbound.classify import classify_reply, stated_retry_delay, suppresses

C = Category

# (code, enhanced code, text, expected category). Texts as the servers send them (multi-line
# replies joined), with addresses and IPs replaced.
CASES: list[tuple[int, str | None, str, Category]] = [
    # ---- Gmail
    (
        550,
        "5.1.1",
        "The email account that you tried to reach does not exist. Please try double-checking "
        "the recipient's email address for typos or unnecessary spaces. For more information, "
        "go to https://support.google.com/mail/?p=NoSuchUser a1si123 - gsmtp",
        C.INVALID_RECIPIENT,
    ),
    (
        550,
        "5.2.1",
        "The email account that you tried to reach is inactive. For more information, go to "
        "https://support.google.com/mail/?p=DisabledUser a1si123 - gsmtp",
        C.INVALID_RECIPIENT,
    ),
    (
        550,
        "5.2.1",
        "The email account that you tried to reach is disabled. a1si123 - gsmtp",
        C.INVALID_RECIPIENT,
    ),
    (
        452,
        "4.2.2",
        "The recipient's inbox is out of storage space. Please direct the recipient to "
        "https://support.google.com/mail/?p=OverQuotaTemp a1si123 - gsmtp",
        C.MAILBOX_FULL,
    ),
    (
        552,
        "5.2.2",
        "The email account that you tried to reach is over quota. Please direct the recipient "
        "to https://support.google.com/mail/?p=OverQuotaPerm a1si123 - gsmtp",
        C.MAILBOX_FULL,
    ),
    (
        552,
        "5.2.3",
        "Your message exceeded Google's message size limits. Please visit "
        "https://support.google.com/mail/?p=MaxSizeError to view our size guidelines. - gsmtp",
        C.MESSAGE_TOO_LARGE,
    ),
    (
        450,
        "4.2.1",
        "The user you are trying to contact is receiving mail too quickly. Please resend your "
        "message at a later time. - gsmtp",
        C.RATE_LIMITED,
    ),
    (
        450,
        "4.2.1",
        "The user you are trying to contact is receiving mail at a rate that prevents additional "
        "messages from being delivered. - gsmtp",
        C.RATE_LIMITED,
    ),
    (
        421,
        "4.7.28",
        "[192.0.2.1 15] Our system has detected an unusual rate of unsolicited mail originating "
        "from your IP address. To protect our users from spam, mail sent from your IP address "
        "has been temporarily rate limited. - gsmtp",
        C.RATE_LIMITED,
    ),
    (
        550,
        "5.7.1",
        "[192.0.2.1] Our system has detected that this message is likely unsolicited mail. To "
        "reduce the amount of spam sent to Gmail, this message has been blocked. - gsmtp",
        C.SPAM_BLOCK,
    ),
    (
        552,
        "5.7.0",
        "This message was blocked because its content presents a potential security issue. - gsmtp",
        C.SPAM_BLOCK,
    ),
    (
        550,
        "5.7.26",
        "This mail is unauthenticated, which poses a security risk to the sender and Gmail "
        "users, and has been blocked. The sender must authenticate with at least one of SPF or "
        "DKIM. - gsmtp",
        C.AUTHENTICATION,
    ),
    (
        550,
        "5.7.26",
        "Unauthenticated email from example.com is not accepted due to domain's DMARC policy. "
        "- gsmtp",
        C.AUTHENTICATION,
    ),
    (554, "5.7.5", "Permanent error evaluating DMARC policy - gsmtp", C.AUTHENTICATION),
    (
        550,
        "5.7.25",
        "[192.0.2.1] The IP address sending this message does not have a PTR record setup, or "
        "the corresponding forward DNS entry does not point to the sending IP. - gsmtp",
        C.AUTHENTICATION,
    ),
    (
        421,
        "4.7.0",
        "[2001:db8::1] This message does not meet IPv6 sending guidelines regarding PTR records "
        "and authentication. - gsmtp",
        C.AUTHENTICATION,
    ),
    (
        550,
        "5.7.1",
        "[192.0.2.1] Messages missing a valid address in From: header, or having no From: "
        "header, are not accepted. - gsmtp",
        C.POLICY,
    ),
    (421, "4.3.0", "Temporary System Problem.  Try again later (10). - gsmtp", C.OTHER),
    (530, "5.7.0", "Must issue a STARTTLS command first. - gsmtp", C.TLS),
    (
        550,
        "5.7.27",
        "The sender address has null MX: it does not accept mail. - gsmtp",
        C.POLICY,  # about our sender, never suppresses the recipient
    ),
    # ---- Outlook / Microsoft 365
    (
        550,
        "5.5.0",
        "Requested action not taken: mailbox unavailable (S2017062302). "
        "[AM0PR01MB1234.eurprd01.prod.exchangelabs.com]",
        C.INVALID_RECIPIENT,
    ),
    (
        550,
        "5.4.1",
        "Recipient address rejected: Access denied. For more information see "
        "https://aka.ms/EXOSmtpErrors AS(201806281) [DB5PEPF00000001.eurprd01.prod.outlook.com]",
        C.INVALID_RECIPIENT,
    ),
    (
        550,
        "5.1.10",
        "RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address lookup",
        C.INVALID_RECIPIENT,
    ),
    (
        550,
        "5.7.606",
        "Access denied, banned sending IP [192.0.2.1]. To request removal from this list please "
        "visit https://sender.office.com/ and follow the directions. AS(1430)",
        C.BLOCKLISTED,
    ),
    (
        550,
        "5.7.1",
        "Unfortunately, messages from [192.0.2.1] weren't sent. Please contact your Internet "
        "service provider since part of their network is on our block list (S3150).",
        C.BLOCKLISTED,
    ),
    (
        451,
        "4.7.500",
        "Server busy. Please try again later from [192.0.2.1]. (S77714) "
        "[VI1EUR01FT001.eop-EUR01.prod.protection.outlook.com]",
        C.RATE_LIMITED,
    ),
    (
        550,
        "5.7.509",
        "Access denied, sending domain example.com does not pass DMARC verification and has a "
        "DMARC policy of reject.",
        C.AUTHENTICATION,
    ),
    (
        554,
        "5.2.2",
        "mailbox full; STOREDRV.Deliver.Exception:QuotaExceededException.MapiExceptionShutoffQuota",
        C.MAILBOX_FULL,
    ),
    (
        552,
        "5.3.4",
        "Message size exceeds fixed maximum message size",
        C.MESSAGE_TOO_LARGE,
    ),
    (
        550,
        "5.7.520",
        "Access denied, Your organization does not allow external forwarding.",
        C.POLICY,
    ),
    (
        421,
        "4.7.66",
        "TLS 1.0 and 1.1 are not supported. Please upgrade/update your client to support TLS 1.2.",
        C.TLS,
    ),
    # ---- Yahoo / AOL
    (
        554,
        None,
        "delivery error: dd This user doesn't have a yahoo.com account (bob@yahoo.com) [0] - "
        "mta1011.mail.ne1.yahoo.com",
        C.INVALID_RECIPIENT,
    ),
    (
        554,
        None,
        "delivery error: dd Sorry your message to bob@yahoo.com cannot be delivered. This mailbox "
        "is disabled (554.30). - mta1011.mail.gq1.yahoo.com",
        C.INVALID_RECIPIENT,
    ),
    (552, None, "1 Requested mail action aborted, mailbox not found", C.INVALID_RECIPIENT),
    (
        421,
        "4.7.0",
        "[TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected volume or user "
        "complaints - 4.16.55.1; see https://postmaster.yahooinc.com/error-codes",
        C.RATE_LIMITED,
    ),
    (
        553,
        "5.7.2",
        "[TSS09] All messages from 192.0.2.1 will be permanently deferred; Retrying will NOT "
        "succeed. See https://postmaster.yahooinc.com/error-codes",
        C.BLOCKLISTED,
    ),
    (
        554,
        "5.7.9",
        "Message not accepted for policy reasons.  See https://postmaster.yahooinc.com/error-codes",
        C.POLICY,
    ),
    (
        550,
        "5.7.9",
        "This mail has been blocked because the sender is unauthenticated. Yahoo requires all "
        "senders to authenticate with either SPF or DKIM.",
        C.AUTHENTICATION,
    ),
    (554, None, "30 Sorry, your message size exceeds 41943040 bytes.", C.MESSAGE_TOO_LARGE),
    (
        553,
        "5.7.1",
        "[BL21] Connections will not be accepted from 192.0.2.1, because the ip is in "
        "Spamhaus's list; see http://postmaster.yahoo.com/errors/550-bl23.html",
        C.BLOCKLISTED,
    ),
    # ---- Postfix, Exim, Sendmail, qmail and friends
    (
        550,
        "5.1.1",
        "<bob@example.net>: Recipient address rejected: User unknown in virtual mailbox table",
        C.INVALID_RECIPIENT,
    ),
    (
        550,
        "5.1.1",
        "<bob@example.net>: Recipient address rejected: User unknown in local recipient table",
        C.INVALID_RECIPIENT,
    ),
    (550, None, "Unrouteable address", C.INVALID_RECIPIENT),
    (550, "5.1.1", "<bob@example.net>... User unknown", C.INVALID_RECIPIENT),
    (550, None, "No such user here", C.INVALID_RECIPIENT),
    (551, "5.1.6", "User has moved; please try <bob@elsewhere.example>", C.INVALID_RECIPIENT),
    (550, "5.1.1", "", C.INVALID_RECIPIENT),  # only the enhanced code to go by
    (554, "5.7.1", "<bob@example.net>: Relay access denied", C.POLICY),
    (
        553,
        None,
        "sorry, that domain isn't in my list of allowed rcpthosts (#5.7.1)",
        C.POLICY,
    ),
    (
        450,
        "4.1.2",
        "<bob@nowhere.example>: Recipient address rejected: Domain not found",
        C.BAD_DOMAIN,
    ),
    (
        450,
        "4.1.8",
        "<alice@nowhere.example>: Sender address rejected: Domain not found",
        C.POLICY,  # our sender's domain, not the recipient's
    ),
    (550, "5.1.2", "Bad destination system address", C.BAD_DOMAIN),
    (
        554,
        "5.7.1",
        "Service unavailable; Client host [192.0.2.1] blocked using zen.spamhaus.org; "
        "https://www.spamhaus.org/query/ip/192.0.2.1",
        C.BLOCKLISTED,
    ),
    (
        550,
        None,
        "Message rejected because 192.0.2.1 is listed by bl.spamcop.net",
        C.BLOCKLISTED,
    ),
    (
        450,
        "4.7.1",
        "Client host rejected: cannot find your reverse hostname, [192.0.2.1]",
        C.AUTHENTICATION,
    ),
    (
        450,
        "4.2.0",
        "<bob@example.net>: Recipient address rejected: Greylisted, see "
        "http://postgrey.schweikert.ch/help/example.net.html",
        C.GREYLISTED,
    ),
    (451, "4.7.1", "Please try again later", C.GREYLISTED),
    (452, "4.5.3", "Error: too many recipients", C.RATE_LIMITED),
    (421, "4.7.0", "mx.example.net Error: too many connections from 192.0.2.1", C.RATE_LIMITED),
    # Gmail's throttle says nothing but "later"; Microsoft's 4.7.650 may come without its words.
    (421, "4.7.0", "Try again later, closing connection. - gsmtp", C.RATE_LIMITED),
    (
        451,
        "4.7.650",
        "The mail server [192.0.2.1] has been temporarily rate limited due to IP reputation.",
        C.RATE_LIMITED,
    ),
    (451, "4.7.650", "(S775)", C.RATE_LIMITED),
    (552, "5.3.4", "Message size exceeds fixed limit", C.MESSAGE_TOO_LARGE),
    (452, "4.3.1", "Insufficient system storage", C.OTHER),
    (554, "5.7.1", "Rejected by SpamAssassin: score 12.3", C.SPAM_BLOCK),
    (550, None, "High probability of spam", C.SPAM_BLOCK),
    (
        554,
        "5.7.1",
        "Message rejected because it contains a virus (Eicar-Test-Signature)",
        C.SPAM_BLOCK,
    ),
    (550, "5.7.1", "Delivery not authorized, message refused", C.POLICY),
    (550, None, "Administrative prohibition", C.POLICY),
    (454, "4.7.0", "TLS not available due to local problem", C.TLS),
    (535, "5.7.8", "Error: authentication failed: authentication failure", C.AUTHENTICATION),
    (535, "5.7.8", "Authentication credentials invalid", C.AUTHENTICATION),
    (421, None, "Service not available, closing transmission channel", C.CONNECTION),
    (421, "4.4.2", "mx.example.net Error: timeout exceeded", C.CONNECTION),
    (500, "5.5.2", "Error: bad syntax", C.PROTOCOL),
    (503, None, "Bad sequence of commands", C.PROTOCOL),
    (554, "5.4.14", "Hop count exceeded - possible mail loop", C.OTHER),
    (550, None, "Rejected", C.OTHER),
    (451, None, "Temporary local problem - please try later", C.OTHER),
    (552, None, "Requested mail action aborted: exceeded storage allocation", C.MAILBOX_FULL),
    (550, None, "5.1.1 <bob@example.net>: unknown address", C.INVALID_RECIPIENT),
    (550, None, "5.2.1 mailbox disabled", C.INVALID_RECIPIENT),
    (450, None, "Requested mail action not taken: mailbox unavailable", C.OTHER),
    # ---- local failures (no server said anything: code 0)
    (0, None, "connection refused by 192.0.2.25:25", C.CONNECTION),
    (0, "4.4.1", "connect to mx.example.net[192.0.2.25]:25: timed out", C.CONNECTION),
    (0, None, "Connection reset by peer", C.CONNECTION),
    (0, None, "TLS handshake failed: certificate verify failed", C.TLS),
    (0, "5.1.10", "example.net publishes a null MX: it accepts no mail", C.BAD_DOMAIN),
    (0, "5.1.2", "example.invalid does not exist (NXDOMAIN)", C.BAD_DOMAIN),
    (0, "4.4.3", "DNS lookup of example.net failed: SERVFAIL", C.DNS),
    (0, "4.4.3", "", C.DNS),
    (0, None, "expired after 5d in the queue; last reply: 451 4.7.1 later", C.EXPIRED),
    (0, None, "not attempted: bob@example.net is on the suppression list", C.SUPPRESSED),
    (0, None, "", C.OTHER),
]


@pytest.mark.parametrize(("code", "enhanced", "text", "expected"), CASES)
def test_replies_get_their_category(
    code: int, enhanced: str | None, text: str, expected: Category
) -> None:
    category, rule = classify_reply(Reply(code, enhanced, text))
    assert category == expected, f"rule {rule} chose {category}"


def test_every_rule_names_a_known_category_and_names_are_unique() -> None:
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert all(isinstance(r.category, Category) for r in RULES)


def test_the_rule_that_matched_is_returned() -> None:
    assert classify_reply(Reply(550, "5.1.1", "user unknown")) == (
        Category.INVALID_RECIPIENT,
        "unknown-mailbox",
    )
    assert classify_reply(Reply(550, "5.1.1", "")).rule == "enhanced-bad-mailbox"


def test_text_is_matched_whatever_its_case_and_line_breaks() -> None:
    assert classify_reply(Reply(550, None, "USER\r\n   UNKNOWN")).category == C.INVALID_RECIPIENT


def test_only_invalid_recipients_and_bad_domains_suppress() -> None:
    assert SUPPRESSING_CATEGORIES == {C.INVALID_RECIPIENT, C.BAD_DOMAIN}
    assert suppresses("invalid-recipient") and suppresses(C.BAD_DOMAIN)
    assert not suppresses("mailbox-full") and not suppresses(None)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("4.7.0 Try again in 60 seconds", 60),
        ("Too many messages, retry after 5 minutes", 300),
        ("rate limited; please  try again\nin 2 min", 120),
        ("Throttled: retry in 1 hour", 3600),
        ("back off, try again after 10s", 10),
        ("retry in 99999 hours", 3600),  # at most an hour, whatever a server says
        ("Try again later, closing connection", None),
        ("mailbox full, 5 minutes of fame", None),
    ],
)
def test_a_retry_delay_stated_in_the_reply_is_found(text: str, seconds: float | None) -> None:
    assert stated_retry_delay(text) == seconds
