"""Numbers and codes are read as ASCII digits (plain.py), and text from outside made plain."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pigeon_mta.plain import is_digits, is_enhanced_code, plain_text

PACKAGE = Path(__file__).resolve().parents[2] / "pigeon_mta"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_pattern_in_the_package_reads_digits_with_backslash_d() -> None:
    """`\\d` takes every script's digits (U+0661 in `550 5.\u0661.1`): [0-9] or plain.py."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
                value = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
                if "\\d" in value.replace("\\\\", ""):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    # plain.py's docstring names it to say why.
    assert [f for f in found if not f.startswith("plain.py:")] == []


def test_no_isdigit_outside_plain() -> None:
    """str.isdigit() is true for "\u0661\u0662", and int() then reads 12: `is_digits` instead."""
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in _sources()
        if path.name != "plain.py"
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in ("isdigit", "isdecimal", "isnumeric")
    ]
    assert found == []


@pytest.mark.parametrize(
    ("text", "digits"),
    [("25", True), ("", False), ("\u0661\u0662", False), ("2\uff15", False), ("-1", False)],
)
def test_is_digits(text: str, digits: bool) -> None:
    assert is_digits(text) is digits


@pytest.mark.parametrize(
    ("code", "ok"),
    [
        ("5.1.1", True),
        ("4.7.650", True),
        ("5.\u0661.1", False),
        ("6.1.1", False),
        (None, False),
        ("5.1.1 ", False),
        ("5.1234.1", False),
    ],
)
def test_is_enhanced_code(code: str | None, ok: bool) -> None:
    assert is_enhanced_code(code) is ok


def test_plain_text_is_one_bounded_line_of_printable_ascii() -> None:
    assert plain_text("550 5.\u0661.1\r\nUser\x00 unknown\t!") == "550 5.\\u0661.1 User unknown !"
    assert plain_text("caf\udce9") == "caf\\udce9"
    cut = plain_text("x" * 2000, 100)
    assert len(cut) == 100 and cut.endswith("...")
    assert plain_text("\U0001f600" * 10, 1000).isascii()
