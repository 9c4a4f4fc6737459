"""Feedback messages as mail systems send them, for the feedback tests: DSNs (RFC 3464, as Postfix
writes them), complaint reports (ARF, RFC 5965: its own examples and reports shaped like Yahoo's
and Microsoft JMRP's), a qmail bounce (no standard) and a human's reply. CRLF line ends."""

from __future__ import annotations

ORIGINAL_HEADERS = """Return-Path: <{return_path}>
From: App <app@acme.example>
To: {recipient}
Subject: Your order
Message-ID: <{message_id}>
Date: Fri, 04 Dec 2026 01:00:00 +0000"""


def crlf(text: str) -> bytes:
    return text.replace("\r\n", "\n").replace("\n", "\r\n").encode()


def dsn(
    *,
    to: str,
    recipient: str,
    message_id: str = "order-1@acme.example",
    return_path: str | None = None,
    action: str = "failed",
    status: str = "5.1.1",
    diagnostic: str = "smtp; 550 5.1.1 <{recipient}>: Recipient address rejected: User unknown",
    report_id: str = "20261204011500.4ABC@mx.dest.test",
    original: str = "headers",
) -> bytes:
    """A DSN as Postfix sends it: notification, delivery-status, the original's header (or the
    whole original, `original="message"`, or none, `""`)."""
    headers = ORIGINAL_HEADERS.format(
        return_path=return_path or to, recipient=recipient, message_id=message_id
    )
    third = ""
    if original == "headers":
        third = f"""--B1
Content-Description: Undelivered Message Headers
Content-Type: text/rfc822-headers

{headers}

"""
    elif original == "message":
        third = f"""--B1
Content-Description: Undelivered Message
Content-Type: message/rfc822

{headers}

Thank you for your order.

"""
    return crlf(
        f"""Return-Path: <>
From: MAILER-DAEMON@mx.dest.test (Mail Delivery System)
Subject: Undelivered Mail Returned to Sender
To: {to}
Auto-Submitted: auto-replied
MIME-Version: 1.0
Message-ID: <{report_id}>
Content-Type: multipart/report; report-type=delivery-status;
\tboundary="B1"

This is a MIME-encapsulated message.

--B1
Content-Description: Notification
Content-Type: text/plain; charset=us-ascii

I'm sorry to have to inform you that your message could not
be delivered to one or more recipients.

--B1
Content-Description: Delivery report
Content-Type: message/delivery-status

Reporting-MTA: dns; mx.dest.test
X-Postfix-Queue-ID: 4ABC
Arrival-Date: Fri,  4 Dec 2026 01:00:00 +0000 (UTC)

Final-Recipient: rfc822; {recipient}
Original-Recipient: rfc822;{recipient}
Action: {action}
Status: {status}
Diagnostic-Code: {diagnostic.format(recipient=recipient)}

{third}--B1--
"""
    )


def arf(
    *,
    to: str = "fbl@acme.example",
    feedback_type: str = "abuse",
    original_mail_from: str | None = None,
    original_rcpt_to: str | None = None,
    recipient_in_original: str = "user@example.com",
    message_id: str = "order-1@acme.example",
    return_path: str = "app@acme.example",
    original: str = "message",
    user_agent: str = "SomeGenerator/1.0",
    report_id: str = "arf-1@reports.example.net",
) -> bytes:
    """An ARF report (RFC 5965 section 2), the original attached whole, as its header or not at
    all; Original-Mail-From and Original-Rcpt-To when given."""
    fields = [f"Feedback-Type: {feedback_type}", f"User-Agent: {user_agent}", "Version: 1"]
    if original_mail_from:
        fields.append(f"Original-Mail-From: <{original_mail_from}>")
    if original_rcpt_to:
        fields.append(f"Original-Rcpt-To: <{original_rcpt_to}>")
    fields += ["Arrival-Date: Fri, 4 Dec 2026 01:00:00 +0000", "Source-IP: 192.0.2.1"]
    headers = ORIGINAL_HEADERS.format(
        return_path=return_path, recipient=recipient_in_original, message_id=message_id
    )
    third = ""
    if original == "message":
        third = f"""--part1
Content-Type: message/rfc822
Content-Disposition: inline

{headers}

Thank you for your order.
"""
    elif original == "headers":
        third = f"""--part1
Content-Type: text/rfc822-headers

{headers}
"""
    newline = "\n"
    return crlf(
        f"""From: <abusedesk@reports.example.net>
Date: Fri, 4 Dec 2026 02:00:00 +0000
Subject: FW: Your order
To: <{to}>
Message-ID: <{report_id}>
MIME-Version: 1.0
Content-Type: multipart/report; report-type=feedback-report;
     boundary="part1"

--part1
Content-Type: text/plain; charset="US-ASCII"
Content-Transfer-Encoding: 7bit

This is an email abuse report for an email message received from IP
192.0.2.1 on Fri, 4 Dec 2026 01:00:00 +0000.

--part1
Content-Type: message/feedback-report

{newline.join(fields)}

{third}--part1--
"""
    )


# RFC 5965 Appendix B.1, as published: the simplest report.
RFC5965_B1 = crlf(
    """From: <abusedesk@example.com>
Date: Thu, 8 Mar 2005 17:40:36 EDT
Subject: FW: Earn money
To: <abuse@example.net>
MIME-Version: 1.0
Content-Type: multipart/report; report-type=feedback-report;
     boundary="part1_13d.2e68ed54_boundary"

--part1_13d.2e68ed54_boundary
Content-Type: text/plain; charset="US-ASCII"
Content-Transfer-Encoding: 7bit

This is an email abuse report for an email message received from IP
192.0.2.1 on Thu, 8 Mar 2005 14:00:00 EDT.  For more information
about this format please see http://www.mipassoc.org/arf/.

--part1_13d.2e68ed54_boundary
Content-Type: message/feedback-report

Feedback-Type: abuse
User-Agent: SomeGenerator/1.0
Version: 1

--part1_13d.2e68ed54_boundary
Content-Type: message/rfc822
Content-Disposition: inline

Received: from mailserver.example.net
        (mailserver.example.net [192.0.2.1])
        by example.com with ESMTP id M63d4137594e46;
        Thu, 08 Mar 2005 14:00:00 -0400
From: <somespammer@example.net>
To: <Undisclosed Recipients>
Subject: Earn money
MIME-Version: 1.0
Content-type: text/plain
Message-ID: 8787KJKJ3K4J3K4J3K4J3.mail@example.net
Date: Thu, 02 Sep 2004 12:31:03 -0500

Spam Spam Spam
Spam Spam Spam
Spam Spam Spam
Spam Spam Spam
--part1_13d.2e68ed54_boundary--
"""
)


def qmail_bounce(*, to: str, recipient: str) -> bytes:
    """qmail's bounce: no DSN, a text a detector must know."""
    return crlf(
        f"""Return-Path: <>
From: MAILER-DAEMON@mx.qmail.test
To: {to}
Subject: failure notice
Message-ID: <qmail-1@mx.qmail.test>

Hi. This is the qmail-send program at mx.qmail.test.
I'm afraid I wasn't able to deliver your message to the following addresses.
This is a permanent error; I've given up. Sorry it didn't work out.

<{recipient}>:
Sorry, no mailbox here by that name. (#5.1.1)

--- Below this line is a copy of the message.

Return-Path: <{to}>
From: app@acme.example
Subject: Your order

Thank you for your order.
"""
    )


def human_reply(*, to: str) -> bytes:
    return crlf(
        f"""From: Ann <ann@dest.test>
To: {to}
Subject: Re: Your order
Message-ID: <reply-1@dest.test>

thanks!
"""
    )


def nested_multipart(depth: int, size: int) -> bytes:
    """A message of `depth` nested multiparts and about `size` bytes of filler: hostile."""
    head = "".join(
        f'Content-Type: multipart/mixed; boundary="b{i}"\n\n--b{i}\n' for i in range(depth)
    )
    filler = ("x" * 76 + "\n") * (size // 77)
    tail = "".join(f"\n--b{i}--\n" for i in reversed(range(depth)))
    return crlf(f"From: x@y.test\nSubject: nested\nMIME-Version: 1.0\n{head}\n{filler}{tail}")
