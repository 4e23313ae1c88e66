"""The package's layout (issue 37): folders that are floors, and old paths stored runs name.

The engine's private modules sit in folders (``_fleet``, ``_execution``, ``_deploys``,
``_protocol``; see docs/development.md). Each folder and each top-level module is a
node; their imports must not circle, or "what a folder may import" (its docstring)
would mean nothing. And a run pickled before the moves names classes by their old
module paths: it must still load.
"""

from __future__ import annotations

import ast
import base64
import pickletools
from pathlib import Path

from durable_steps import Context, PickleSerializer
from durable_steps._deploys.fork import ForkRefused
from durable_steps._execution.waits import Suspend

PACKAGE = Path(__file__).resolve().parent.parent / "durable_steps"
FRONT = ("cli", "ui")  # one floor: the page calls the commands, the commands serve the page


def _unit(parts: tuple[str, ...]) -> str:
    if len(parts) < 2:
        return parts[0]
    return "cli+ui" if parts[1] in FRONT else parts[1].removesuffix(".py")


def _exists(dotted: str) -> bool:
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        mine = graph.setdefault(_unit(tuple(name.split("."))), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = package.split(".")
                    base = ".".join([*pkg[: len(pkg) - node.level + 1], *[node.module or ""]])
                    base = base.rstrip(".")
                else:
                    base = node.module or ""
                subs = [f"{base}.{a.name}" for a in node.names if _exists(f"{base}.{a.name}")]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                # The package itself (its __init__, the public facade) is a node too: it
                # imports the engine, so an engine module importing it closes a circle.
                if target == "durable_steps" or (
                    target.startswith("durable_steps.") and _exists(target)
                ):
                    unit = _unit(tuple(target.split(".")))
                    if unit != _unit(tuple(name.split("."))):
                        mine.add(unit)
    return graph


def test_folders_and_top_modules_import_without_circles() -> None:
    graph = _graph()
    cycles: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "folder import circles: " + "; ".join(cycles)
    # the floors, bottom up (a sample of the order the docstrings state)
    assert "_protocol" not in graph["_execution"] | graph["_deploys"] | graph["_fleet"]
    assert "_execution" not in graph["_fleet"]


def test_few_private_modules_at_the_top_and_none_too_long() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("_*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 8, f"{len(top)} private modules at the top of durable_steps/: {top}"
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 550
    }
    assert not long, f"modules over 550 lines: {long}"


def test_each_private_folder_says_what_it_holds_and_may_import() -> None:
    for init in PACKAGE.glob("_*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.parent.name}/__init__.py has no docstring"
        if init.parent.name != "_record":
            assert "May import" in doc, f"{init.parent.name}/__init__.py: say what it may import"


# cloudpickle of {"annotation": Context, "kept": ForkRefused(...), "seen": Suspend},
# written before issue 37's moves: it names the modules they were in then.
BEFORE_THE_MOVES = (
    "gAWV5wAAAAAAAAB9lCiMCmFubm90YXRpb26UjBZkdXJhYmxlX3N0ZXBzLl9jb250ZXh0lIwHQ29udGV4dJSTlIwEa2Vw"
    "dJSMFGR1cmFibGVfc3RlcHMuZXJyb3JzlIwIX3JlYnVpbGSUk5SME2R1cmFibGVfc3RlcHMuX2ZvcmuUjAtGb3JrUmVm"
    "dXNlZJSTlIwWcnVuIHcvciBhbHJlYWR5IGV4aXN0c5R9lCiMA3J1bpSMA3cvcpSMBHN0ZXCUTnWHlFKUjARzZWVulIwU"
    "ZHVyYWJsZV9zdGVwcy5fd2FpdHOUjAdTdXNwZW5klJOUdS4="
)


def test_a_state_pickled_before_the_moves_still_loads() -> None:
    blob = base64.b64decode(BEFORE_THE_MOVES)
    named = {a for _, a, _ in pickletools.genops(blob) if isinstance(a, str)}
    assert {f"durable_steps.{old}" for old in ("_context", "_fork", "_waits")} <= named
    state = PickleSerializer().loads(blob)
    assert state["annotation"] is Context
    assert type(state["kept"]) is ForkRefused
    assert state["kept"].run == "w/r"
    assert state["seen"] is Suspend
