"""The package's imports only go down: no module imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "durable_steps"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports, at any level (TYPE_CHECKING and
    function-level imports included: a circle there is still a circle).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names} & modules.keys()
            targets |= subs
            if len(subs) < len(node.names) and module in modules:
                targets.add(module)
        elif isinstance(node, ast.Import):
            targets |= {a.name for a in node.names} & modules.keys()
    # A module's own package (an __init__ it sits under) is imported first anyway.
    return {t for t in targets if t != name and not name.startswith(f"{t}.")}


def test_no_module_imports_one_that_imports_it_back() -> None:
    """The import graph of durable_steps has no cycle, TYPE_CHECKING imports included."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_core_never_imports_the_cli_or_an_integration() -> None:
    """Modules below the CLI, the web page and the integrations never import them (they
    are the top floor)."""
    modules = _modules()
    top = ("durable_steps.cli", "durable_steps.ui", "durable_steps.integrations")
    for name, path in modules.items():
        if name.startswith(top) or name == "durable_steps.__main__":
            continue
        wrong = {t for t in _imports(name, path, modules) if t.startswith(top)}
        assert not wrong, f"{name} imports {sorted(wrong)}"
