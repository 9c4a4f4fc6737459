"""Address rules: what becomes a queued mailbox, and what is refused and why."""

from __future__ import annotations

import ipaddress

import pytest

from pigeon_mta.intake.addresses import (
    AddressProblem,
    Mailbox,
    client_address,
    in_networks,
    parse_mailbox,
    split_path,
)


@pytest.mark.parametrize(
    ("text", "local", "domain"),
    [
        ("user@example.com", "user", "example.com"),
        ("User.Name+tag@Example.COM", "User.Name+tag", "example.com"),
        ('"quoted@local"@example.com', '"quoted@local"', "example.com"),
        ('"with space"@example.com', '"with space"', "example.com"),
        ("user%other.example@example.com", "user%other.example", "example.com"),
        ("host!user@example.com", "host!user", "example.com"),
        ("user@bücher.example", "user", "xn--bcher-kva.example"),
        ("user@localhost", "user", "localhost"),
    ],
)
def test_accepted_mailboxes(text: str, local: str, domain: str) -> None:
    smtputf8 = not text.isascii()
    assert parse_mailbox(text, smtputf8=smtputf8) == Mailbox(local, domain)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", AddressProblem.SYNTAX),
        ("user", AddressProblem.SYNTAX),
        ("user@", AddressProblem.SYNTAX),
        ("@example.com", AddressProblem.SYNTAX),
        ("host!user", AddressProblem.SYNTAX),
        ("user@example.com.", AddressProblem.SYNTAX),
        ("user@-bad.example", AddressProblem.SYNTAX),
        ("user@exa_mple.com", AddressProblem.SYNTAX),
        ("user@192.0.2.1", AddressProblem.SYNTAX),
        ("us er@example.com", AddressProblem.SYNTAX),
        ("user..x@example.com", AddressProblem.SYNTAX),
        ("user@example.com@other.example", AddressProblem.SYNTAX),
        ("user\x00@example.com", AddressProblem.SYNTAX),
        ("user\udcff@example.com", AddressProblem.SYNTAX),
        ("x" * 300 + "@example.com", AddressProblem.SYNTAX),
        ("user@[192.0.2.1]", AddressProblem.LITERAL),
        ("user@[IPv6:::1]", AddressProblem.LITERAL),
        ("jörg@example.com", AddressProblem.NEEDS_SMTPUTF8),
    ],
)
def test_refused_mailboxes(text: str, problem: AddressProblem) -> None:
    assert parse_mailbox(text, smtputf8=False) == problem


def test_utf8_local_part_with_smtputf8() -> None:
    assert parse_mailbox("jörg@example.com", smtputf8=True) == Mailbox("jörg", "example.com")


def test_client_addresses_and_networks() -> None:
    trusted = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))
    mapped = client_address(("::ffff:10.1.2.3", 25, 0, 0))
    assert mapped == ipaddress.ip_address("10.1.2.3")
    assert in_networks(mapped, trusted)
    assert in_networks(client_address(("::1", 25, 0, 0)), trusted)
    assert not in_networks(client_address(("192.0.2.1", 25)), trusted)
    assert not in_networks(client_address(None), trusted)


@pytest.mark.parametrize(
    ("arg", "address", "rest"),
    [
        ("<a@b.example>", "a@b.example", ""),
        ("<a@b.example> SIZE=100 BODY=8BITMIME", "a@b.example", "SIZE=100 BODY=8BITMIME"),
        ("<>", "<>", ""),
        ("<> SIZE=5", "<>", "SIZE=5"),
        ("< a@b.example >", "a@b.example", ""),
        ("<@relay.example,@other.example:a@b.example>", "a@b.example", ""),
        ('<"x>y"@b.example>', '"x>y"@b.example', ""),
        ('<"x\\"y>"@b.example> P=1', '"x\\"y>"@b.example', "P=1"),
        ("a@b.example SIZE=1", "a@b.example", "SIZE=1"),
        ("", "", ""),
        ("<", None, None),
        ("<a@", None, None),
        ("<a@b.example>x", None, None),
        ("<@relay.example a@b.example>", None, None),
        ('<"unterminated@b.example>', None, None),
    ],
)
def test_split_path(arg: str, address: str | None, rest: str | None) -> None:
    assert split_path(arg) == (address, rest)
