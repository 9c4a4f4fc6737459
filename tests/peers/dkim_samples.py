"""Messages that DKIM signers get wrong: 8-bit bodies, folded long headers, bodies with and without
a final CRLF, blank-line and whitespace tails, an empty body, a 5 KB HTML body. Every one has
exactly one From and one Date field, as libopendkim's strict header check requires."""

from __future__ import annotations

_COMMON = (
    b"Date: Sun, 29 Nov 2026 15:00:00 +0000\r\n"
    b"Message-ID: <20261129150000.4711@example.com>\r\n"
    b"MIME-Version: 1.0\r\n"
)


def _message(headers: bytes, body: bytes) -> bytes:
    return headers + _COMMON + b"\r\n" + body


SAMPLES: dict[str, bytes] = {
    "plain": _message(
        b"From: Alice <alice@example.com>\r\nTo: bob@example.net\r\nSubject: Hello\r\n"
        b"Content-Type: text/plain; charset=us-ascii\r\n",
        b"Hello Bob,\r\n\r\nSee you tomorrow.\r\n",
    ),
    "eight_bit": _message(
        b"From: =?utf-8?q?J=C3=BCrgen?= <juergen@example.com>\r\nTo: bob@example.net\r\n"
        b"Subject: =?utf-8?b?R3LDvMOfZQ==?=\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n",
        "Grüße aus Köln — 日本語のテキスト, £5 \r\nzweite Zeile\tmit Tab\r\n".encode()
        + b"latin-1 byte: \xe9\r\n",
    ),
    "folded_long_headers": _message(
        b"From: Alice Example With A Rather Long Display Name <alice@example.com>\r\n"
        b"To: first.recipient@example.net, second.recipient@example.net,\r\n"
        b"\tthird.recipient@example.net, fourth.recipient@example.net,\r\n"
        b"  fifth.recipient@example.net\r\n"
        b"Cc: carol@example.org\r\n"
        b"Reply-To: replies@example.com\r\n"
        b"Subject: A subject line that is long enough that the submitting client folded it\r\n"
        b" onto a second line,   with   runs of   spaces\r\n"
        b"\tand a third line after a tab\r\n"
        b"List-Unsubscribe: <https://example.com/unsubscribe/0123456789abcdef0123456789abcdef>,\r\n"
        b" <mailto:unsubscribe@example.com?subject=0123456789abcdef>\r\n"
        b"List-Unsubscribe-Post: List-Unsubscribe=One-Click\r\n"
        b"Received: from client.example.org (client.example.org [192.0.2.7])\r\n"
        b"\tby mta.example.com; Sun, 29 Nov 2026 15:00:00 +0000\r\n"
        b"X-Mailer: not signed\r\n",
        b"Body.\r\n",
    ),
    "no_final_crlf": _message(
        b"From: alice@example.com\r\nTo: bob@example.net\r\nSubject: no final line end\r\n",
        b"first line\r\nlast line without CRLF",
    ),
    "trailing_blank_lines_and_spaces": _message(
        b"From: alice@example.com\r\nTo: bob@example.net\r\nSubject: tails\r\n",
        b"line with trailing spaces   \r\n\tindented\twith  tabs \t\r\n\r\n  \r\n\r\n\r\n",
    ),
    "empty_body": _message(
        b"From: alice@example.com\r\nTo: bob@example.net\r\nSubject: nothing\r\n", b""
    ),
    "html_5k": _message(
        b"From: Newsletter <news@example.com>\r\nTo: bob@example.net\r\nSubject: News\r\n"
        b"Content-Type: text/html; charset=utf-8\r\n",
        b"<html>\r\n  <body>\r\n"
        + b"    <p>Lorem ipsum dolor sit amet,  consectetur\tadipiscing elit. </p>\r\n" * 70
        + b"  </body>\r\n</html>\r\n",
    ),
}
