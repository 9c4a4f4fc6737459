"""What feedback/parse.py reads in the reports mail systems send: DSNs (RFC 3464), ARF complaint
reports (RFC 5965), a qmail bounce through flufl.bounce, and what is none of these."""

from __future__ import annotations

import pytest

from pigeon_mta.feedback.parse import read_report
from tests.peers import feedback_reports as reports

VERP = "b-" + "a" * 40 + "@bounces.acme.example"


def test_a_postfix_dsn_is_a_hard_bounce_with_its_codes_and_the_original() -> None:
    report = read_report(reports.dsn(to=VERP, recipient="nobody@dest.test"))
    assert report.kind == "bounce"
    [item] = report.items
    assert (item.kind, item.address, item.hard) == ("bounce", "nobody@dest.test", True)
    assert (item.code, item.enhanced_code, item.category) == (550, "5.1.1", "invalid-recipient")
    assert "User unknown" in item.text
    assert report.original_message_id == "order-1@acme.example"
    assert report.original_senders == (VERP,)
    assert report.own_message_id == "20261204011500.4ABC@mx.dest.test"


@pytest.mark.parametrize("original", ["headers", "message", ""])
def test_the_original_part_may_be_headers_a_message_or_missing(original: str) -> None:
    report = read_report(reports.dsn(to=VERP, recipient="nobody@dest.test", original=original))
    assert report.kind == "bounce" and report.items[0].hard
    expected = "order-1@acme.example" if original else None
    assert report.original_message_id == expected


def test_a_full_mailbox_is_a_soft_bounce_and_a_delay_is_a_delay() -> None:
    full = read_report(
        reports.dsn(
            to=VERP,
            recipient="ann@dest.test",
            status="5.2.2",
            diagnostic="smtp; 552 5.2.2 <{recipient}>: Mailbox full",
        )
    )
    assert full.kind == "bounce"
    assert (full.items[0].hard, full.items[0].category) == (False, "mailbox-full")
    delayed = read_report(
        reports.dsn(
            to=VERP,
            recipient="ann@dest.test",
            action="delayed",
            status="4.4.1",
            diagnostic="smtp; 451 4.4.1 connection timed out",
        )
    )
    assert delayed.kind == "delay"
    assert (delayed.items[0].kind, delayed.items[0].hard) == ("delay", False)


def test_a_delivered_action_reports_nothing() -> None:
    report = read_report(
        reports.dsn(to=VERP, recipient="ann@dest.test", action="delivered", status="2.0.0")
    )
    assert report.kind is None and report.items == ()


def test_rfc5965s_simplest_example_is_an_abuse_complaint() -> None:
    report = read_report(reports.RFC5965_B1)
    assert report.kind == "complaint"
    [item] = report.items
    assert (item.kind, item.hard, item.feedback_type) == ("complaint", True, "abuse")
    assert report.original_message_id == "8787KJKJ3K4J3K4J3K4J3.mail@example.net"


@pytest.mark.parametrize("original", ["message", "headers", ""])
def test_a_complaint_names_original_rcpt_to_and_the_original_envelope_sender(
    original: str,
) -> None:
    report = read_report(
        reports.arf(
            original_mail_from=VERP,
            original_rcpt_to="ann@dest.test",
            original=original,
            return_path=VERP,
        )
    )
    assert report.kind == "complaint"
    assert [i.address for i in report.items] == ["ann@dest.test"]
    assert report.original_senders[0] == VERP


def test_a_yahoo_shaped_complaint_without_original_rcpt_to_names_the_originals_to() -> None:
    # Yahoo's and Microsoft JMRP's reports leave Original-Rcpt-To out; the original is attached,
    # with pigeon's return path in it.
    report = read_report(
        reports.arf(
            user_agent="Yahoo!-Mail-Feedback/2.0",
            recipient_in_original="ann@yahoo.test",
            return_path=VERP,
        )
    )
    assert report.kind == "complaint"
    assert [i.address for i in report.items] == ["ann@yahoo.test"]
    assert report.original_senders == (VERP,)


def test_not_spam_is_no_complaint() -> None:
    report = read_report(reports.arf(feedback_type="not-spam", original_rcpt_to="a@b.test"))
    assert report.kind is None
    assert "not-spam" in report.detail


def test_a_qmail_bounce_is_read_by_the_detectors() -> None:
    report = read_report(reports.qmail_bounce(to=VERP, recipient="nobody@qmail.test"))
    assert report.kind == "bounce"
    assert [(i.address, i.hard) for i in report.items] == [("nobody@qmail.test", True)]


def test_a_reply_or_garbage_is_not_understood() -> None:
    for data in (reports.human_reply(to=VERP), b"", b"\x00\xff" * 1000, b"Subject: x\r\n"):
        report = read_report(data)
        assert report.kind is None and report.items == ()
        assert report.detail


def test_a_megabyte_of_nested_multiparts_is_read_without_an_exception() -> None:
    for depth in (50, 5000):
        report = read_report(reports.nested_multipart(depth, 1_000_000))
        assert report.kind is None
