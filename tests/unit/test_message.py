"""The header section: where it ends, its fields by reception's and by the signer's rule, and the
From: domain that the sender policy and the DKIM signer both go by."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pigeon_mta.header_bounds import FieldBounds, FieldProblem
from pigeon_mta.intake.addresses import Mailbox, parse_mailbox
from pigeon_mta.intake.fixups import Trace, apply_fixups
from pigeon_mta.message import (
    HeaderTooLarge,
    UnreadableHeader,
    address_domains,
    field_name,
    field_value,
    from_domain,
    signing_fields,
    split_at_blank_line,
    split_header,
)

MBOX_LINE = b"From alice@example.com Sun Nov 29 15:00:00 2026\r\n"


def _trace() -> Trace:
    return Trace(
        hostname="mta.test",
        queue_id="QID",
        client_ip="192.0.2.7",
        helo="client.example",
        esmtp=True,
        smtputf8=False,
        tls_version=None,
        tls_cipher=None,
        auth_user="alice",
        recipients=("bob@example.net",),
        received_at=datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC),
    )


def _queued(raw: bytes) -> bytes:
    return apply_fixups(raw, _trace(), new_message_id="new@mta.test").data


# ---------------------------------------------------------------- where the header ends


@pytest.mark.parametrize(
    ("message", "header", "body"),
    [
        (b"A: 1\r\nB: 2\r\n\r\nbody\r\n\r\nmore", b"A: 1\r\nB: 2", b"body\r\n\r\nmore"),
        (b"A: 1\nB: 2\n\nbody", b"A: 1\nB: 2", b"body"),
        (b"A: 1\r\n\nbody", b"A: 1", b"body"),
        (b"A: 1\r\nB: 2\r\n", b"A: 1\r\nB: 2\r\n", b""),
    ],
)
def test_the_header_section_ends_at_the_first_blank_line(
    message: bytes, header: bytes, body: bytes
) -> None:
    assert split_at_blank_line(message) == (header, body)


# ---------------------------------------------------------------- the two rules


@pytest.mark.parametrize(
    ("header", "fields", "rest"),
    [
        (  # a folded field stays whole
            b"Subject: a\r\n long\r\n\tmore\r\nFrom: x@y\r\n\r\nbody\r\n",
            [b"Subject: a\r\n long\r\n\tmore\r\n", b"From: x@y\r\n"],
            b"\r\nbody\r\n",
        ),
        (  # a line without a colon starts the body
            b"From: x@y\r\nno colon here\r\nTo: z@y\r\n\r\nbody\r\n",
            [b"From: x@y\r\n"],
            b"no colon here\r\nTo: z@y\r\n\r\nbody\r\n",
        ),
        (  # so does white space before the colon (RFC 5322 2.2 has none)
            b"From : x@y\r\n\r\nbody\r\n",
            [],
            b"From : x@y\r\n\r\nbody\r\n",
        ),
        (  # and an mbox "From " line
            MBOX_LINE + b"From: x@y\r\n\r\nbody\r\n",
            [],
            MBOX_LINE + b"From: x@y\r\n\r\nbody\r\n",
        ),
        (b"From: x@y\r\nTo: z@y", [b"From: x@y\r\n", b"To: z@y\r\n"], b""),
    ],
)
def test_split_header_at_reception(header: bytes, fields: list[bytes], rest: bytes) -> None:
    split = split_header(header)
    assert (split.fields, split.rest) == (fields, rest)


@pytest.mark.parametrize(
    ("header", "fields"),
    [
        (
            b"Subject: a\r\n long\r\n\tmore\r\nFrom: x@y",
            [(b"Subject", b" a\r\n long\r\n\tmore\r\n"), (b"From", b" x@y\r\n")],
        ),
        (MBOX_LINE + b"From: x@y", [(b"From", b" x@y\r\n")]),  # skipped, as dkimpy does
        (b"X-Empty:\nTo:z@y", [(b"X-Empty", b"\r\n"), (b"To", b"z@y\r\n")]),
        (b"From : x@y\r\nTo: z@y", [(b"To", b" z@y\r\n")]),  # "From " reads as mbox
    ],
)
def test_signing_fields_as_dkimpy_reads_them(
    header: bytes, fields: list[tuple[bytes, bytes]]
) -> None:
    assert signing_fields(header) == fields


@pytest.mark.parametrize(
    "header",
    [
        b" a continuation first\r\nFrom: x@y",
        b"From: x@y\r\nno colon here",
    ],
)
def test_a_line_the_signer_cannot_read_is_an_error(header: bytes) -> None:
    with pytest.raises(UnreadableHeader):
        signing_fields(header)


@pytest.mark.parametrize(
    "raw",
    [
        b"From: a@x.example\r\nSubject: s\r\n folded\r\n\r\nbody\r\n",
        b"From: a@x.example\nSubject: bare LF\n\nbody\n",
        b"From: a@x.example\r\nno colon here\r\nTo: b@y.example\r\n\r\nbody\r\n",
        MBOX_LINE + b"From: a@x.example\r\n\r\nbody\r\n",
        b"From : a@x.example\r\n\r\nbody\r\n",
        b"From: a@x.example\r\n",
    ],
)
def test_the_two_rules_read_a_queued_message_alike(raw: bytes) -> None:
    """Reception decides where the header ends; on what it queued, the signer reads the same
    fields with the same values."""
    queued = _queued(raw)
    by_reception = [(field_name(f), field_value(f)) for f in split_header(queued).fields]
    header, _body = split_at_blank_line(queued)
    by_signer = [(n.lower(), field_value(n + b":" + v)) for n, v in signing_fields(header)]
    assert by_signer == by_reception


def test_a_field_folded_into_many_lines_is_read_in_one_pass() -> None:
    """80,000 continuation lines: each rule joins a field's lines once (adding them one by one was
    quadratic and took seconds)."""
    folded = b"Subject: x\r\n" + b" y\r\n" * 80_000
    message = folded + b"From: x@y.example\r\n\r\nbody\r\n"
    assert split_header(message).fields == [folded, b"From: x@y.example\r\n"]
    header, _body = split_at_blank_line(message)
    assert [name for name, _value in signing_fields(header)] == [b"Subject", b"From"]
    assert from_domain(message) == "y.example"


def test_a_header_section_over_the_limit_is_refused_and_a_large_body_is_not() -> None:
    header = b"From: x@y\r\nSubject: " + b"s" * 80 + b"\r\n"  # 103 octets
    split = split_header(header + b"\r\n" + b"body\r\n" * 100, max_size=len(header))
    assert split.fields == [b"From: x@y\r\n", header[11:]]
    with pytest.raises(HeaderTooLarge):
        split_header(header + b"\r\nbody\r\n", max_size=len(header) - 1)
    with pytest.raises(HeaderTooLarge):  # a continuation line counts too
        split_header(header + b" more\r\n\r\nbody\r\n", max_size=len(header))


# ---------------------------------------------------------------- the From: domain


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("App <app@Acme.Example>", {"acme.example"}),
        ("a@x.example, B <b@y.example>", {"x.example", "y.example"}),
        ('"Doe, J" <j@x.example>, (a, comment) k@y.example', {"x.example", "y.example"}),
        ("John Q. Public <john@x.example>", {"x.example"}),
        ('"ceo@acme.example" <evil@other.example>', {"other.example"}),
        ("=?utf-8?q?ceo@acme.example?= <evil@other.example>", {"other.example"}),
        ("Team: a@x.example;", {"x.example"}),
        ("undisclosed-recipients:;", set()),
        ("App <app@Bücher.example>", {"xn--bcher-kva.example"}),
        ("", set()),
        ("Doe, John <j@x.example>", FieldProblem.UNPARSEABLE),  # "Doe" is no address
        ("a@good.example@evil.example", FieldProblem.UNPARSEABLE),
        ("alice@example.org)<bob@evil.example>", FieldProblem.UNPARSEABLE),
        ("nobody", FieldProblem.UNPARSEABLE),
        ("a@[192.0.2.1]", FieldProblem.UNPARSEABLE),
        ("x <a@b.example> \x00", FieldProblem.UNPARSEABLE),
        ("(" * 9 + ")" * 9 + " a@x.example", FieldProblem.UNPARSEABLE),
        ("(" * 8 + ")" * 8 + " a@x.example", {"x.example"}),
        (", ".join(["a@x.example"] * 101), FieldProblem.TOO_MANY_ADDRESSES),
        (", ".join(["a@x.example"] * 100), {"x.example"}),
        ("x " * 300 + "<a@x.example>", FieldProblem.TOO_LONG),  # one address over 512
        (", ".join(["Display Name <someone@x.example>"] * 90), FieldProblem.TOO_LONG),  # > 2048
    ],
)
def test_address_domains(value: str, expected: set[str] | FieldProblem) -> None:
    assert address_domains(value, FieldBounds(max_length=2048)) == expected


@pytest.mark.parametrize(
    ("message", "domain"),
    [
        (b"From: Alice <alice@Example.COM>\r\n\r\nx", "example.com"),
        (b'Subject: s\r\nfrom: "Doe, J" <j@ex.org>,\r\n k@ex.org\r\n\r\nx', "ex.org"),
        (b"From: j@ex.org (Doe, J)\r\n\r\nx", "ex.org"),
        (MBOX_LINE + b"From: a@ex.org\r\n\r\nx", "ex.org"),
        (b"From: a@one.example, b@two.example\r\n\r\nx", None),
        (b"From: a@one.example\r\nFrom: b@one.example\r\n\r\nx", None),
        (b"To: b@example.net\r\n\r\nFrom: not-a-header@example.com\r\n", None),
        (b"From: undisclosed\r\n\r\nx", None),
        (b"From: Doe, John <j@ex.org>\r\n\r\nx", None),
        (b"From: a@b\xff.example\r\n\r\nx", None),
        ("From: a@bücher.example\r\n\r\nx".encode(), "xn--bcher-kva.example"),
    ],
)
def test_from_domain(message: bytes, domain: str | None) -> None:
    assert from_domain(message) == domain


@pytest.mark.parametrize(
    "message",
    [
        b"From: a@example.com\r\nno colon on this line\r\n\r\nx",
        b"From: " + b"(" * 20_000 + b")" * 20_000 + b" a@example.com\r\n\r\nx",  # no recursion
        b"From: " + b", ".join(b"u%d@example.com" % i for i in range(101)) + b"\r\n\r\nx",
        b"From: " + b"x" * 9000 + b" <a@example.com>\r\n\r\nx",
    ],
)
def test_from_domain_refuses_what_it_cannot_read_within_the_bounds(message: bytes) -> None:
    with pytest.raises(UnreadableHeader):
        from_domain(message)


@pytest.mark.parametrize(
    "from_",
    [
        '"Doe, John" <app@acme.example>',
        "Doe, John <app@acme.example>",
        "=?utf-8?q?Doe=2C_John?= <app@acme.example>",
        "=?utf-8?q?boss@other.example?= <app@acme.example>",
        "Team: app@acme.example;",
        "Team: app@acme.example, ops@acme.example;",
        "App <app@Bücher.example>",
        "app@acme.example (Doe, John)",
        "undisclosed-recipients:;",
    ],
)
def test_the_sender_policy_and_the_signer_read_one_from_domain(from_: str) -> None:
    """What the strict sender policy checks at reception is what the signer signs for in the
    message as queued: never a domain the policy did not see, and nothing it refused."""
    bounds = FieldBounds()
    fixed = apply_fixups(
        f"From: {from_}\r\nTo: bob@example.net\r\n\r\nhi\r\n".encode(),
        _trace(),
        new_message_id="new@mta.test",
    )
    [(_name, value)] = fixed.address_fields
    checked = address_domains(value, bounds)
    signed_for = from_domain(fixed.data, bounds)
    if isinstance(checked, FieldProblem) or len(checked) != 1:
        assert signed_for is None
    else:
        assert {signed_for} == checked


def test_an_address_domain_is_spelled_as_routing_spells_it() -> None:
    assert parse_mailbox("a@faß.de", smtputf8=True) == Mailbox("a", "xn--fa-hia.de")
    assert from_domain("From: a@faß.de\r\n\r\nx".encode()) == "xn--fa-hia.de"
