"""What a send request becomes (api/compose.py): pure, on bytes."""

from __future__ import annotations

import base64
import email
import email.policy
import json
from typing import Any

import pytest

from pigeon_mta.api.compose import from_json, from_raw
from pigeon_mta.api.problems import Problem
from pigeon_mta.config import LimitsSettings

LIMITS = LimitsSettings()


def build(**request: Any) -> tuple[tuple[str, ...], email.message.EmailMessage]:
    submission = from_json(json.dumps(request).encode(), LIMITS)
    parsed = email.message_from_bytes(submission.data, policy=email.policy.default)
    assert isinstance(parsed, email.message.EmailMessage)
    return submission.recipients, parsed


def test_non_ascii_names_and_subject_are_encoded_and_the_text_kept() -> None:
    recipients, message = build(
        **{"from": "Jürgen Ölmann <j@acme.example>"},
        to="Zoë <zoe@dest.example>",
        subject="Grüße — your order",
        text="Danke schön\n",
    )
    assert recipients == ("zoe@dest.example",)
    assert message["From"] == "Jürgen Ölmann <j@acme.example>"
    assert message["Subject"] == "Grüße — your order"
    # The SMTP policy writes the text with CRLF line ends.
    assert message.get_content() == "Danke schön\r\n"
    # Header and body as queued fit 7-bit transport.
    assert message.as_bytes(policy=email.policy.SMTP).isascii()


def test_text_html_and_attachments_make_one_mime_tree() -> None:
    pdf = b"%PDF-1.4 fake"
    _recipients, message = build(
        **{"from": "j@acme.example"},
        to="a@dest.example",
        text="plain",
        html="<p>rich</p>",
        attachments=[
            {
                "filename": "bill.pdf",
                "content_type": "application/pdf",
                "content": base64.b64encode(pdf).decode(),
            }
        ],
    )
    assert message.get_content_type() == "multipart/mixed"
    body = message.get_body(("html", "plain"))
    assert body is not None and body.get_content() == "<p>rich</p>\r\n"
    (attachment,) = list(message.iter_attachments())
    assert attachment.get_filename() == "bill.pdf"
    assert attachment.get_content_type() == "application/pdf"
    assert attachment.get_content() == pdf


def test_every_line_fits_seven_bit_transport_and_the_text_comes_back_the_same() -> None:
    word = "w" * 2000
    long_line = "y" * 300
    submission = from_json(
        json.dumps(
            {
                "from": "j@acme.example",
                "to": "a@dest.example",
                "subject": f"one {word} two",
                "headers": {"X-Note": "a " * 100},
                "text": f"short\n{long_line}\n",
                "html": "<p>plain ascii</p>",
            }
        ).encode(),
        LIMITS,
    )
    lines = submission.data.split(b"\r\n")
    assert submission.data.isascii() and max(len(line) for line in lines) <= 998
    message = email.message_from_bytes(submission.data, policy=email.policy.default)
    assert isinstance(message, email.message.EmailMessage)
    assert message["Subject"] == f"one {word} two"
    assert message["X-Note"].split() == ["a"] * 100
    text = message.get_body(("plain",))
    html = message.get_body(("html",))
    assert text is not None and html is not None
    assert text["Content-Transfer-Encoding"] == "quoted-printable"  # a line over 78
    assert text.get_content() == f"short\r\n{long_line}\r\n"
    assert html["Content-Transfer-Encoding"] == "7bit"
    assert html.get_content() == "<p>plain ascii</p>\r\n"
    # One MIME-Version, at the top.
    assert submission.data.count(b"MIME-Version:") == 1


def test_names_with_specials_html_alone_and_a_non_ascii_file_name_come_back_the_same() -> None:
    _recipients, message = build(
        **{"from": 'Shop "North", Ltd <shop@acme.example>'},
        to=["Doe, Jane <jane@dest.example>", "x@dest.example"],
        reply_to="Zoë <help@acme.example>",
        html="<p>only html</p>",
        attachments=[
            {
                "filename": "Rechnung März.pdf",
                "content_type": "application/pdf",
                "content": base64.b64encode(b"%PDF").decode(),
            }
        ],
    )
    assert message["From"].addresses[0].display_name == 'Shop "North", Ltd'
    assert [a.display_name for a in message["To"].addresses] == ["Doe, Jane", ""]
    assert message["Reply-To"] == "Zoë <help@acme.example>"
    body = message.get_body(("html", "plain"))
    assert body is not None and body.get_content_type() == "text/html"
    assert body.get_content() == "<p>only html</p>\r\n"
    (attachment,) = list(message.iter_attachments())
    assert attachment.get_filename() == "Rechnung März.pdf"
    assert attachment.get_content() == b"%PDF"
    assert message.as_bytes(policy=email.policy.SMTP).isascii()


def test_recipients_are_to_cc_and_bcc_once_each_and_bcc_stays_out_of_the_header() -> None:
    recipients, message = build(
        **{"from": "j@acme.example"},
        to=["a@dest.example", "b@DEST.example"],
        cc="b@dest.example",
        bcc=["hidden@dest.example"],
        text="x",
    )
    assert recipients == ("a@dest.example", "b@dest.example", "hidden@dest.example")
    assert message["Bcc"] is None and b"hidden" not in message.as_bytes()


def test_a_raw_message_is_made_crlf_and_its_long_lines_folded() -> None:
    raw = b"From: j@acme.example\nSubject: s\n\n" + b"x" * 1200 + b"\n"
    submission = from_raw(raw, ["j@acme.example"], ["a@dest.example"], LIMITS)
    lines = submission.data.split(b"\r\n")
    assert b"\n" not in submission.data.replace(b"\r\n", b"")
    assert max(len(line) for line in lines) <= 998
    refusing = LimitsSettings(long_lines="refuse")
    with pytest.raises(Problem) as info:
        from_raw(raw, ["j@acme.example"], ["a@dest.example"], refusing)
    assert info.value.kind.slug == "invalid-message"


def test_wrapped_base64_and_a_media_type_with_parameters_are_taken() -> None:
    """Attachments as common libraries write them: base64 in lines of 76 (Python's
    encodebytes, PHP's chunk_split) and a content type with parameters."""
    csv = ("name,amount\r\n" + "ann,42\r\n" * 40).encode()
    _recipients, message = build(
        **{"from": "j@acme.example"},
        to="a@dest.example",
        text="plain",
        attachments=[
            {
                "filename": "bill.csv",
                "content_type": 'text/csv; charset=utf-8; header="present";',
                "content": base64.encodebytes(csv).decode(),
            }
        ],
    )
    (attachment,) = list(message.iter_attachments())
    assert attachment.get_content_type() == "text/csv"
    assert attachment.get_param("charset") == "utf-8"
    assert attachment.get_param("header") == "present"
    assert attachment.get_payload(decode=True) == csv


@pytest.mark.parametrize(
    "content_type",
    ["text/csv; charset", "text/csv; a=b\r\nBcc: x@y", 'text/csv; a="b\\"c"', "text/csv;" * 10],
)
def test_a_media_type_whose_parameters_are_not_name_value_is_refused(content_type: str) -> None:
    with pytest.raises(Problem, match="content_type"):
        build(
            **{"from": "j@acme.example"},
            to="a@dest.example",
            text="plain",
            attachments=[{"filename": "a", "content_type": content_type, "content": "YQ=="}],
        )


def test_an_inline_image_goes_in_multipart_related_beside_the_html() -> None:
    """An attachment with a `content_id` is an inline part the html names as cid: (RFC 2387):
    text and html, then the image, in multipart/related; a plain attachment after that, in
    multipart/mixed. A content id with a space or an angle bracket is refused."""
    png = b"\x89PNG fake"
    _recipients, message = build(
        **{"from": "j@acme.example"},
        to="a@dest.example",
        text="plain",
        html='<p><img src="cid:logo@acme"></p>',
        attachments=[
            {
                "filename": "logo.png",
                "content_type": "image/png",
                "content": base64.b64encode(png).decode(),
                "content_id": "logo@acme",
            },
            {"filename": "terms.txt", "content_type": "text/plain", "content": "dGVybXM="},
        ],
    )
    assert message.get_content_type() == "multipart/mixed"
    related, terms = message.get_payload()
    assert related.get_content_type() == "multipart/related"
    alternative, logo = related.get_payload()
    assert alternative.get_content_type() == "multipart/alternative"
    assert logo["Content-ID"] == "<logo@acme>"
    assert logo.get_content_disposition() == "inline" and logo.get_payload(decode=True) == png
    assert terms.get_content_disposition() == "attachment" and terms["Content-ID"] is None
    for bad in ("logo acme", "<logo>", 'lo"go', ""):
        with pytest.raises(Problem, match="content_id"):
            build(
                **{"from": "j@acme.example"},
                to="a@dest.example",
                html="<p>x</p>",
                attachments=[
                    {
                        "filename": "a",
                        "content_type": "image/png",
                        "content": "YQ==",
                        "content_id": bad,
                    }
                ],
            )
