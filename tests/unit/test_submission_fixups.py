"""RFC 6409 fixups and reply codes: pure functions on bytes and strings."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pigeon_mta.intake.fixups import Trace, apply_fixups, normalize_line_endings
from pigeon_mta.submission import replies

NOW = datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)


def trace(**changes: object) -> Trace:
    values: dict[str, object] = {
        "hostname": "mta.test",
        "queue_id": "QID",
        "client_ip": "192.0.2.7",
        "helo": "client.example",
        "esmtp": True,
        "smtputf8": False,
        "tls_version": "TLSv1.3",
        "tls_cipher": "TLS_AES_256_GCM_SHA384",
        "auth_user": "alice",
        "recipients": ("bob@example.net",),
        "received_at": NOW,
    }
    values.update(changes)
    return Trace(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        (b"a\r\nb\r\n", b"a\r\nb\r\n"),
        (b"a\nb\n", b"a\r\nb\r\n"),
        (b"a\rb\r\n", b"a\r\nb\r\n"),
        (b"a\n.\r\nb", b"a\r\n.\r\nb"),
        (b"\r\r\n\n", b"\r\n\r\n\r\n"),
    ],
)
def test_line_endings(raw: bytes, normalized: bytes) -> None:
    assert normalize_line_endings(raw) == normalized


def test_missing_message_id_and_date_are_added_and_trace_goes_on_top() -> None:
    fixed = apply_fixups(b"Subject: hi\r\n\r\nbody\r\n", trace(), new_message_id="new@mta.test")
    assert fixed.header_message_id == "new@mta.test"
    assert fixed.data == (
        b"Received: from client.example ([192.0.2.7])\r\n"
        b"\t(using TLSv1.3 with cipher TLS_AES_256_GCM_SHA384)\r\n"
        b"\tby mta.test (pigeon-mta) with ESMTPSA id QID\r\n"
        b"\tfor <bob@example.net>;\r\n"
        b"\tMon, 06 May 2024 07:08:09 +0000\r\n"
        b"Authentication-Results: mta.test; auth=pass smtp.auth=alice\r\n"
        b"Subject: hi\r\n"
        b"Message-ID: <new@mta.test>\r\n"
        b"Date: Mon, 06 May 2024 07:08:09 +0000\r\n"
        b"\r\nbody\r\n"
    )


def test_existing_headers_are_kept() -> None:
    raw = b"Message-ID:\r\n <abc@app>\r\nDate: Sun, 5 May 2024 00:00:00 +0000\r\nFrom: a@b\r\n\r\nx\r\n"
    fixed = apply_fixups(raw, trace(), new_message_id="unused@mta.test")
    assert fixed.header_message_id == "abc@app"
    assert fixed.data.endswith(raw)
    assert fixed.address_fields == [("from", "a@b")]


def test_body_without_blank_line_is_not_taken_for_header() -> None:
    fixed = apply_fixups(b"Subject: x\r\njust text\r\n", trace(), new_message_id="n@m")
    assert fixed.data.endswith(b"Date: Mon, 06 May 2024 07:08:09 +0000\r\n\r\njust text\r\n")


def test_trace_without_tls_auth_or_single_recipient() -> None:
    fixed = apply_fixups(
        b"\r\nbody",
        trace(tls_version=None, auth_user=None, recipients=("a@x", "b@y"), helo="bad (helo)\\"),
        new_message_id="n@m",
    )
    assert fixed.data.startswith(
        b"Received: from bad??helo?? ([192.0.2.7])\r\n\tby mta.test (pigeon-mta) with ESMTP id QID;\r\n"
    )
    assert b"Authentication-Results: mta.test; auth=none\r\n" in fixed.data
    assert fixed.data.endswith(b"\r\nbody\r\n")


def test_only_our_own_authentication_results_are_removed() -> None:
    raw = (
        b"Authentication-Results: MTA.test; auth=pass smtp.auth=ceo\r\n"
        b"Authentication-Results: mta.test.evil; spf=pass\r\n\r\n"
    )
    fixed = apply_fixups(raw, trace(), new_message_id="n@m")
    assert b"smtp.auth=ceo" not in fixed.data
    assert b"mta.test.evil; spf=pass" in fixed.data


@pytest.mark.parametrize(
    ("stock", "sent"),
    [
        ("250 OK", "250 2.0.0 Ok"),
        ("503 Error: need RCPT command", "503 5.5.1 Error: need RCPT command"),
        ("552 Error: Too much mail data", replies.MESSAGE_TOO_BIG),
        ("500 Error: bad syntax", "500 5.5.2 Error: bad syntax"),
        ("553 5.1.3 Error: malformed address", "553 5.1.3 Error: malformed address"),
        ("354 End data with <CR><LF>.<CR><LF>", "354 End data with <CR><LF>.<CR><LF>"),
        (replies.RELAY_DENIED, replies.RELAY_DENIED),
    ],
)
def test_enhanced_codes_on_stock_replies(stock: str, sent: str) -> None:
    assert replies.with_enhanced_code(stock) == sent


def test_rejection_reasons_are_a_fixed_set() -> None:
    assert replies.rejection_reason(replies.RELAY_DENIED) == "relay_denied"
    assert replies.rejection_reason("500 5.5.2 Error: bad syntax <user input>") == "protocol"
