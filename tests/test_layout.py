"""The package's shape: no circles among its modules' top-level imports (the scheduler,
runner and kernels share their types through batch.py, not through each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import constrained_serve

ROOT = Path(constrained_serve.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, name: str) -> set[str]:
    """Modules of the package this file imports at its top level, type-only imports
    (under TYPE_CHECKING) included: a circle of types is a circle too."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    body = ast.parse(path.read_text()).body
    for node in list(body):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body.extend(node.body)
    for node in body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("constrained_serve"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import x`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("constrained_serve"))
    return out


# Type-only back-references from a handle to the owner that made it: the handle's methods
# call back into its owner, so the two are one unit split over two files.
OWNER_BACK_REFERENCES = {
    ("constrained_serve.grammar.matchers", "constrained_serve.grammar.manager"),
}


def test_no_import_cycles_between_modules():
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {
        name: {m for m in _top_level_imports(path, name) if m in files and m != name} for name, path in files.items()
    }
    # A package's __init__ importing its own modules is how packages work, not a circle.
    for name in graph:
        graph[name] = {
            m for m in graph[name] if not m.startswith(name + ".") and (name, m) not in OWNER_BACK_REFERENCES
        }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

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
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
