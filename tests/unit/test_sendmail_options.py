"""The sendmail door's command line as cron, PHP and scripts write it, and what it reads of the
message: -t's recipients without Bcc, a lone dot ending the message unless -i, From: added."""

from __future__ import annotations

import pytest

from pigeon_mta.commands.sendmail_message import (
    Options,
    UsageError,
    header_recipients,
    parse,
    read_message,
    with_from,
)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-t", "-i"], Options(from_headers=True, dot_ends=False)),
        (["-oi", "-odi", "-oem", "a@x.test"], Options(recipients=["a@x.test"], dot_ends=False)),
        (["-f", "<app@x.test>", "-Fcron daemon", "b@x.test"], Options(
            recipients=["b@x.test"], sender="app@x.test", full_name="cron daemon"
        )),
        (["-fapp@x.test", "-bm", "-C", "/etc/p.toml", "-v", "-N", "never", "--", "-c@x.test"],
         Options(recipients=["-c@x.test"], sender="app@x.test", config="/etc/p.toml",
                 verbose=True)),
        (["-r", "", "c@x.test"], Options(recipients=["c@x.test"], sender="")),
    ],
)  # fmt: skip
def test_the_options_callers_use(argv: list[str], expected: Options) -> None:
    assert parse(argv) == expected


@pytest.mark.parametrize(
    ("argv", "problem"),
    [(["-bs"], "-bs is not supported"), (["-q1h"], "unknown option -q1h"), (["-f"], "needs")],
)
def test_what_it_does_not_do_is_a_usage_error(argv: list[str], problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        parse(argv)


def test_the_message_as_read() -> None:
    data = b"Subject: x\n\none\n.\ntwo\n"
    assert read_message(data, dot_ends=True) == b"Subject: x\n\none\n"
    assert read_message(data, dot_ends=False) == data
    found, message = header_recipients(
        b"To: Ann <ann@x.test>, bob@x.test\nBcc: hidden@x.test\nCc: c@x.test\n\nbody\n"
    )
    assert found == ["ann@x.test", "bob@x.test", "hidden@x.test", "c@x.test"]
    assert message == b"To: Ann <ann@x.test>, bob@x.test\r\nCc: c@x.test\r\n\r\nbody\r\n"
    assert with_from(b"Subject: x\n\nb\n", "cron@x.test", "Cron Daemon").startswith(
        b"From: Cron Daemon <cron@x.test>\r\nSubject: x"
    )
    assert with_from(b"From: a@x.test\n\nb\n", "cron@x.test", None) == b"From: a@x.test\n\nb\n"
