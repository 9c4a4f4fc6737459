"""Files that send the reader to a section of a document (`see deploy/README.md "systemd"`) name
a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

POINTER = re.compile(r'\bsee ([\w./-]+\.md) "([^"]+)"')
SOURCES = sorted((REPO / "systemd").iterdir())


def headings(document: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", document.read_text(), re.M)}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_pointer_names_an_existing_section(source: Path) -> None:
    for document, section in POINTER.findall(source.read_text()):
        path = REPO / document
        assert path.is_file(), f"{source.name} points at {document}, which does not exist"
        assert section in headings(path), (
            f'{source.name} points at {document} "{section}", which has no such section'
        )


def test_the_unit_points_at_its_install_steps() -> None:
    unit = (REPO / "systemd" / "pigeon-mta.service").read_text()
    assert POINTER.findall(unit) == [("deploy/README.md", "systemd")]
