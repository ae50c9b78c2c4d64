"""The grammar package's shape: no circle among its modules' imports, counting every import
statement (inside functions and under TYPE_CHECKING too), so a handle never reaches back to
the manager that made it and the backends never reach back to the tokenizer data."""

from __future__ import annotations

import ast
from pathlib import Path

import constrained_serve.grammar

ROOT = Path(constrained_serve.grammar.__file__).parent
PACKAGE = "constrained_serve.grammar"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                target = f"{PACKAGE}.{node.module}" if node.module else PACKAGE
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import x`
            elif node.level == 0 and (node.module or "").startswith(PACKAGE):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(PACKAGE))
    return out


def test_no_import_circles_in_the_grammar_package():
    files = {f"{PACKAGE}.{p.stem}": p for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    graph = {name: {m for m in _imports(p) if m in files and m != name} for name, p in files.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)
