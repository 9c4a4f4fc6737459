"""DSNs as Python's email package (a real MIME parser) reads them: RFC 3464 fields, parts, safety."""

from __future__ import annotations

import email
import email.message
import email.policy
import uuid
from datetime import UTC, datetime, timedelta

from pigeon_mta.dsn import (
    OriginalMessage,
    RecipientReport,
    build_bounce,
    build_delay_warning,
    header_section,
)
from pigeon_mta.model import Envelope, Reply

HOST = "mta.example.org"
ORIGINAL_BODY = (
    b"From: Alice <alice@example.com>\r\n"
    b"To: bob@example.net, carol@example.net, dave@example.net\r\n"
    b"Subject: quarterly report\r\n"
    b"Message-ID: <abc123@example.com>\r\n"
    b"\r\n"
    b"the secret body\r\n"
)


def original(sender: str = "alice@example.com", body: bytes = ORIGINAL_BODY) -> OriginalMessage:
    return OriginalMessage(
        queue_id=uuid.uuid4(),
        org_id=uuid.uuid4(),
        sender=sender,
        received_at=datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
        header_message_id="abc123@example.com",
        headers=header_section(body),
    )


def parse(envelope: Envelope) -> email.message.EmailMessage:
    msg = email.message_from_bytes(envelope.body, policy=email.policy.default)
    assert isinstance(msg, email.message.EmailMessage)
    return msg


def status_blocks(msg: email.message.EmailMessage) -> list[email.message.Message]:
    (part,) = [p for p in msg.walk() if p.get_content_type() == "message/delivery-status"]
    blocks = part.get_payload()
    assert isinstance(blocks, list)
    return blocks


def test_a_bounce_is_a_multipart_report_with_the_status_and_diagnostic() -> None:
    orig = original()
    env = build_bounce(
        orig,
        [RecipientReport("bob@example.net", Reply(550, "5.1.1", "user unknown"), "mx.example.net")],
        hostname=HOST,
    )
    assert env is not None
    assert env.sender == "" and env.recipients == ("alice@example.com",)
    assert env.org_id == orig.org_id
    msg = parse(env)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert msg["From"].addresses[0].addr_spec == f"MAILER-DAEMON@{HOST}"
    assert msg["To"].addresses[0].addr_spec == "alice@example.com"
    assert msg["Auto-Submitted"] == "auto-replied"
    assert msg["In-Reply-To"] == "<abc123@example.com>"
    assert msg["Message-ID"] == f"<{env.header_message_id}>"
    assert [p.get_content_type() for p in msg.iter_parts()] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]
    per_message, bob = status_blocks(msg)
    assert per_message["Reporting-MTA"] == f"dns; {HOST}"
    assert per_message["Arrival-Date"] == "Wed, 01 May 2024 12:00:00 +0000"
    assert bob["Final-Recipient"] == "rfc822; bob@example.net"
    assert bob["Action"] == "failed"
    assert bob["Status"] == "5.1.1"
    assert bob["Remote-MTA"] == "dns; mx.example.net"
    assert bob["Diagnostic-Code"] == "smtp; 550 5.1.1 user unknown"


def test_the_original_headers_are_returned_but_not_its_body() -> None:
    env = build_bounce(
        original(), [RecipientReport("bob@example.net", Reply(550, "5.1.1", "no"))], hostname=HOST
    )
    assert env is not None
    (headers,) = [p for p in parse(env).walk() if p.get_content_type() == "text/rfc822-headers"]
    text = headers.get_payload(decode=True).decode()
    assert "Subject: quarterly report" in text and "Message-ID: <abc123@example.com>" in text
    assert b"secret body" not in env.body


def test_one_bounce_names_every_failed_recipient() -> None:
    env = build_bounce(
        original(),
        [
            RecipientReport("bob@example.net", Reply(550, "5.1.1", "user unknown"), "mx1"),
            RecipientReport("dave@example.net", Reply(552, "5.2.2", "mailbox full"), "mx2"),
        ],
        hostname=HOST,
    )
    assert env is not None
    _, *recipients = status_blocks(parse(env))
    assert [(b["Final-Recipient"], b["Status"]) for b in recipients] == [
        ("rfc822; bob@example.net", "5.1.1"),
        ("rfc822; dave@example.net", "5.2.2"),
    ]
    human = next(p for p in parse(env).walk() if p.get_content_type() == "text/plain")
    assert "bob@example.net" in human.get_content() and "dave@example.net" in human.get_content()


def test_no_bounce_for_null_sender_mail_or_nothing_failed() -> None:
    report = RecipientReport("bob@example.net", Reply(550, "5.1.1", "user unknown"))
    assert build_bounce(original(sender=""), [report], hostname=HOST) is None
    assert build_bounce(original(), [], hostname=HOST) is None
    assert (
        build_delay_warning(
            original(sender=""), [report], hostname=HOST, retry_until=datetime.now(UTC)
        )
        is None
    )


def test_expiry_reports_failed_with_status_4_4_7_and_the_last_reply() -> None:
    env = build_bounce(
        original(),
        [
            RecipientReport(
                "bob@example.net",
                Reply(451, "4.7.1", "greylisted, try later"),
                "mx.example.net",
                status="4.4.7",
            )
        ],
        hostname=HOST,
    )
    assert env is not None
    _, bob = status_blocks(parse(env))
    assert (bob["Action"], bob["Status"]) == ("failed", "4.4.7")
    assert bob["Diagnostic-Code"] == "smtp; 451 4.7.1 greylisted, try later"


def test_permanent_failure_without_a_5xx_enhanced_code_is_5_0_0() -> None:
    env = build_bounce(
        original(),
        [
            RecipientReport("a@example.net", Reply(554, None, "go away")),
            RecipientReport("b@example.net", Reply(0, "5.1.10", "null MX")),
        ],
        hostname=HOST,
    )
    assert env is not None
    _, a, b = status_blocks(parse(env))
    assert (a["Status"], a["Diagnostic-Code"]) == ("5.0.0", "smtp; 554 go away")
    # A local failure is not an SMTP reply: it gets a private diagnostic type.
    assert (b["Status"], b["Diagnostic-Code"]) == ("5.1.10", "X-Pigeon; 5.1.10 null MX")


def test_delay_warning_says_delayed_and_until_when() -> None:
    until = datetime(2024, 5, 6, 12, 0, tzinfo=UTC)
    env = build_delay_warning(
        original(),
        [RecipientReport("bob@example.net", Reply(451, "4.7.1", "later"), "mx.example.net")],
        hostname=HOST,
        retry_until=until,
    )
    assert env is not None and env.sender == ""
    msg = parse(env)
    assert msg.get_content_type() == "multipart/report"
    _, bob = status_blocks(msg)
    assert (bob["Action"], bob["Status"]) == ("delayed", "4.7.1")
    assert bob["Will-Retry-Until"] == "Mon, 06 May 2024 12:00:00 +0000"


def test_remote_text_cannot_inject_fields_and_long_replies_are_folded() -> None:
    evil = "user unknown\r\nAction: delivered\r\nStatus: 2.0.0 " + "x" * 300
    env = build_bounce(
        original(),
        [RecipientReport("bob@example.net", Reply(550, "5.1.1", evil), "mx\r\nX-Evil: 1")],
        hostname=HOST,
    )
    assert env is not None
    _, bob = status_blocks(parse(env))
    assert bob.get_all("Action") == ["failed"] and bob.get_all("Status") == ["5.1.1"]
    assert bob["X-Evil"] is None
    assert all(len(line) <= 998 for line in env.body.split(b"\r\n"))
    assert b"\n" not in env.body.replace(b"\r\n", b"")


def test_header_section_ends_at_the_first_empty_line_and_is_bounded() -> None:
    assert header_section(b"A: 1\r\nB: 2\r\n\r\nbody\r\n\r\nmore") == b"A: 1\r\nB: 2"
    assert header_section(b"A: 1\nB: 2\n\nbody") == b"A: 1\nB: 2"
    huge = b"".join(b"X-Filler: %d\r\n" % i for i in range(20000)) + b"\r\nbody"
    cut = header_section(huge, limit=1000)
    assert len(cut) <= 1000 and cut.endswith(b"\r\n")


def test_non_ascii_original_headers_travel_as_8bit() -> None:
    body = "Subject: Grüße\r\nFrom: a@example.com\r\n\r\nx".encode()
    env = build_bounce(
        original(body=body),
        [RecipientReport("b@example.net", Reply(550, "5.1.1", "unknown"))],
        hostname=HOST,
        now=datetime.now(UTC) - timedelta(seconds=1),
    )
    assert env is not None
    (headers,) = [p for p in parse(env).walk() if p.get_content_type() == "text/rfc822-headers"]
    assert headers["Content-Transfer-Encoding"] == "8bit"
    assert "Grüße".encode() in env.body


def test_no_line_passes_998_octets_whatever_the_text_is_written_in() -> None:
    """Four-octet characters (an emoji reply, an emoji Message-ID) wrapped by characters made
    lines of 2,000 octets; a word of 8,000 ASCII characters made one of 8,001."""
    emoji = "\U0001f600" * 600
    env = build_bounce(
        OriginalMessage(
            queue_id=uuid.uuid4(),
            org_id=uuid.uuid4(),
            sender="alice@example.com",
            received_at=datetime.now(UTC),
            header_message_id=emoji + "@example.com",
            headers=b"Subject: x\r\n",
        ),
        [
            RecipientReport("bob@example.net", Reply(550, "5.1.1", emoji)),
            RecipientReport("carol@example.net", Reply(550, "5.1.1", "y" * 8000)),
        ],
        hostname=HOST,
    )
    assert env is not None
    assert max(len(line) for line in env.body.split(b"\r\n")) <= 998
