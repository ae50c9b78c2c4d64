"""The package's shape, as docs/architecture.md describes it:

- no import circles among its modules, counting every import statement (top level, inside
  functions, under TYPE_CHECKING): a circle of types or of lazy imports is a circle too;
- the root holds the public API only (at most 14 modules), the layers are packages;
- no module reaches into another object's underscore names;
- docs/architecture.md names every module, and every module it names exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import constrained_serve

ROOT = Path(constrained_serve.__file__).parent
DOC = ROOT.parents[1] / "docs" / "architecture.md"
MAX_ROOT_MODULES = 14


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Modules of the package this file imports anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            out.update(
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("constrained")
            )
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def test_no_import_cycles_between_modules():
    files = _modules()
    # A package's __init__ importing its own modules is how packages work, not a circle.
    graph = {
        name: {m for m in _imports(path, name) if m in files and m != name and not m.startswith(name + ".")}
        for name, path in files.items()
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


def test_the_root_holds_the_public_api_only():
    root_modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, f"{len(root_modules)} modules at the root: {root_modules}"


# Underscore names that are public API of what they belong to: namedtuple's methods.
_NAMEDTUPLE_API = {"_replace", "_make", "_fields", "_asdict", "_field_defaults"}
# Another library's internals, read on purpose (not another object of ours):
_THIRD_PARTY = {
    # transformers' plain _decode, compared to find tokenizers that do not override it
    # (their Rust decode is then called directly: batch_decoder's docstring says why)
    "engine/detokenizer.py": {"type(tokenizer)._decode"},
}


def _reach_ins(path: Path) -> list[str]:
    """``x._name`` where x is neither self nor cls nor an imported module (third-party
    internals, such as torch.ops.mkldnn._linear_pointwise, are that library's business)."""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and re.match(r"_[^_]", node.attr)) or node.attr in _NAMEDTUPLE_API:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        root = node.value
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in imported:
            continue
        where = str(path.relative_to(ROOT))
        if ast.unparse(node) not in _THIRD_PARTY.get(where, ()):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_objects_underscore_names():
    found = [hit for p in sorted(ROOT.rglob("*.py")) for hit in _reach_ins(p)]
    assert not found, "underscore names of other objects:\n" + "\n".join(found)


def test_the_architecture_doc_names_every_module_and_only_those():
    doc = DOC.read_text()
    named = set(re.findall(r"`([\w/]+\.(?:py|c))`", doc))
    every = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.suffix in (".py", ".c")}
    files = {f for f in every if not f.endswith("__init__.py")}  # a package's own is named if it holds code
    missing = sorted(f for f in files if f not in named)
    assert not missing, f"docs/architecture.md does not name: {missing} (name each by its path, e.g. `engine/core.py`)"
    # Test files are named in its Tests section (tests/ mirrors the package), benchmarks as such.
    stale = sorted(
        f for f in named if f not in every and not Path(f).name.startswith("test_") and not f.startswith("benchmarks/")
    )
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
