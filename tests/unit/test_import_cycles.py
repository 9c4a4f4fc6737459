"""No circle among the package's imports: each module can be read after the ones it imports.

Imports inside `if TYPE_CHECKING:` count too, since a circle through them is still a circle for a
reader, and for the type checker.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pigeon_mta"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports (for `from a import b`, a.b when that is a
    module, else a)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    found.add(full)
                elif node.module in modules:
                    found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imports_of(path, modules) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: being visited, 2: done
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            if cycle:
                return cycle
    return None


def test_the_submission_modules_import_in_one_direction() -> None:
    graph = import_graph()
    submission = {
        n: {t for t in g if t.startswith("pigeon_mta.submission.")}
        for n, g in graph.items()
        if n.startswith("pigeon_mta.submission.")
    }
    assert find_cycle(submission) is None


def test_the_package_has_no_import_circle() -> None:
    assert find_cycle(import_graph()) is None
