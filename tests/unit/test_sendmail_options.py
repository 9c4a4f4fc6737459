"""The sendmail door's command line as cron, PHP and scripts write it, and what it reads of the
message: -t's recipients without Bcc, a lone dot ending the message unless -i, From: added."""

from __future__ import annotations

import pytest

from pigeon_mta.commands.sendmail_message import (
    BadAddress,
    Options,
    UsageError,
    addresses_of,
    header_recipients,
    parse,
    read_message,
    with_from,
)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-t", "-i"], Options(from_headers=True, dot_ends=False)),
        (["-ti"], Options(from_headers=True, dot_ends=False)),
        # Debian cron and cronie, as they call it.
        (["-FCronDaemon", "-i", "-B8BITMIME", "-oem", "root"], Options(
            recipients=["root"], full_name="CronDaemon", dot_ends=False
        )),
        (["-FCronDaemon", "-i", "-odi", "-oem", "-oi", "-t", "-f", "root"], Options(
            full_name="CronDaemon", dot_ends=False, from_headers=True, sender="root"
        )),
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
    [
        (["-bs"], "-bs is not supported"),
        (["-bd"], "-bd is not supported"),
        (["-q1h"], "unknown option -q1h"),
        (["-f"], "needs"),
    ],
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


def test_recipient_arguments_as_sendmail_reads_them() -> None:
    assert addresses_of(["root", "a@x.test, Bob <b@x.test>"], "host.test") == [
        "root@host.test",
        "a@x.test",
        "b@x.test",
    ]
    with pytest.raises(BadAddress):
        addresses_of(["not an address"], "host.test")


def test_a_from_field_with_any_name_and_address() -> None:
    assert with_from(b"\n\nx\n", "jos\u00e9@x.test", "Jos\u00e9\r\nBcc: evil@x").startswith(
        "From: Jos\u00e9 Bcc: evil@x <jos\u00e9@x.test>\r\n".encode()
    )
