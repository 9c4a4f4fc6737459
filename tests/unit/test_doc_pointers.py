"""Files that send the reader to a section of a document (`see deploy/README.md "systemd"`) name
a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pigeon_mta.config_build import settings_schema_keys
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


# ---------------------------------------------------------------- the code's own pointers

# The documents a newcomer reads, and the code, whose docstrings and comments name files,
# modules, functions and sections: each name must exist, or the reader is sent nowhere.
DOCUMENTS = [REPO / "README.md", REPO / "bench" / "README.md", REPO / "deploy" / "README.md"]
CODE = sorted([*(REPO / "pigeon_mta").rglob("*.py"), *(REPO / "bench").glob("*.py")])
# A file named with its folder ("store/queue.py", "pigeon_mta/memo.py", "bench/e2e.py").
PATH = re.compile(r"(?<![\w/.-])((?:[a-z_]+/)+[a-z_0-9]+\.(?:py|md|sql|toml))\b")
# A section of a README: `bench/README.md "Queue"`, `(bench/README.md, "Queue")`.
SECTION = re.compile(r'\b((?:[\w-]+/)?README\.md),? "([^"]+)"')
# `module.name` in backquotes: a function, class or constant of a module of ours.
DOTTED = re.compile(r"`((?:[a-z_]+\.)+)([A-Za-z_][A-Za-z_0-9]*)(?:\(\))?`")
SEARCHED = (REPO, REPO / "pigeon_mta")


def _modules() -> dict[str, list[str]]:
    """Dotted module names of the package by every suffix they may be named by: "store.queue"
    and "queue" both name pigeon_mta.store.queue."""
    found: dict[str, list[str]] = {}
    for path in (REPO / "pigeon_mta").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        full = ".".join(parts)
        for start in range(len(parts)):
            found.setdefault(".".join(parts[start:]), []).append(full)
    return found


MODULES = _modules()
SETTINGS_KEYS = set(settings_schema_keys())
FILE_SUFFIXES = {"py", "md", "js", "sql", "toml", "json", "txt", "sh"}


def _text_of(source: Path) -> str:
    return source.read_text(encoding="utf-8")


def _where(source: Path) -> str:
    return str(source.relative_to(REPO))


@pytest.mark.parametrize("source", DOCUMENTS + CODE, ids=_where)
def test_every_file_named_exists(source: Path) -> None:
    text = _text_of(source)
    missing = sorted(
        {
            name
            for name in PATH.findall(text)
            if not any((root / name).exists() for root in (*SEARCHED, source.parent))
        }
    )
    assert not missing, f"{_where(source)} names files that do not exist: {missing}"


@pytest.mark.parametrize("source", DOCUMENTS + CODE, ids=_where)
def test_every_section_named_exists(source: Path) -> None:
    wrong = []
    for document, written in SECTION.findall(_text_of(source)):
        section = re.sub(r"\s+#?\s*", " ", written)  # a name broken over comment lines
        path = REPO / document
        # A heading may say which script it is about after the name: "Queue (`bench/...`)".
        if not path.is_file() or not any(
            h == section or h.startswith(section + " (") for h in headings(path)
        ):
            wrong.append(f'{document} "{section}"')
    assert not wrong, f"{_where(source)} names sections that do not exist: {wrong}"


@pytest.mark.parametrize("source", DOCUMENTS + CODE, ids=_where)
def test_every_function_named_in_backquotes_exists(source: Path) -> None:
    import importlib

    wrong = []
    for prefix, name in DOTTED.findall(_text_of(source)):
        if name in FILE_SUFFIXES or f"{prefix}{name}" in SETTINGS_KEYS:
            continue  # a file name ("signer.py"), a setting ("server.processes")
        candidates = MODULES.get(prefix.rstrip("."))
        if not candidates or len(candidates) > 1:
            continue  # not one module of ours (a setting, a stdlib name, an ambiguous suffix)
        module = importlib.import_module(candidates[0])
        if not hasattr(module, name) and f"{candidates[0]}.{name}" not in MODULES:
            wrong.append(f"{prefix}{name}")
    assert not wrong, f"{_where(source)} names what its module does not have: {wrong}"
