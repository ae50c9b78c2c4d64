"""Every code block in README.md and docs/*.md runs, or says in its fence why it cannot.

Fences: ``python`` blocks run, the blocks of one page in order as one script, on the session's
default-model engine (``Engine()`` with no arguments, and the one-liner's default engine,
are that engine, so the model loads once). A ``text output`` block must equal what the
python block before it printed. ``bash`` blocks hold ``constrained-serve`` commands: each is
parsed by the command's own parser, and ``generate`` / ``info`` also run. ``text``, ``json``,
``jsonl`` blocks are data (JSON must parse). ``no-run`` in a fence (``bash no-run``) skips a
block that cannot run here: a make target, a server, a cluster. Any other fence fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
DATA = {"text", "json", "jsonl"}
# Written by another branch: links to them may be dangling until it lands.
LINK_SLOTS = {"docs/ray.md", "docs/tensor-parallelism.md"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    flags: tuple[str, ...]
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return "no-run" not in self.flags


def blocks(page: Path) -> list[Block]:
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^ {0,3}```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        words = m.group(1).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^ {0,3}```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        out.append(Block(page, start, words[0] if words else "", tuple(words[1:]), "\n".join(body) + "\n"))
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def commands(block: Block) -> list[list[str]]:
    """The block's commands, backslash continuations joined, comments and blank lines dropped."""
    text = re.sub(r"\\\n\s*", " ", block.code)
    return [
        shlex.split(line, comments=True)
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_pages_were_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "api.md", "cli.md", "architecture.md"} <= names
    assert sum(b.lang == "python" and b.runs for b in ALL) >= 10


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_every_block_is_runnable_or_tagged(block: Block) -> None:
    assert block.lang in {"python"} | SHELL | DATA, (
        f"{block.where}: fence {block.lang!r} is neither python, bash nor data; tag it (e.g. 'bash no-run')"
    )
    if block.lang in DATA and block.runs:
        if block.lang == "json":
            json.loads(block.code)
        elif block.lang == "jsonl":
            for line in block.code.splitlines():
                json.loads(line)
    if block.lang in SHELL and block.runs:
        from constrained_serve.cli.command import build_parser

        cmds = commands(block)
        assert cmds, f"{block.where}: an empty shell block"
        for argv in cmds:
            assert argv[0] == "constrained-serve", (
                f"{block.where}: only constrained-serve commands run here; tag the block 'bash no-run': {argv}"
            )
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit as e:  # argparse's way of refusing
                pytest.fail(f"{block.where}: the CLI refuses {shlex.join(argv)} (exit {e.code})")


def test_output_blocks_follow_python() -> None:
    for i, b in enumerate(ALL):
        if b.lang == "text" and "output" in b.flags:
            prev = ALL[i - 1] if i else None
            assert prev and prev.page == b.page and prev.lang == "python" and prev.runs, b.where


def test_relative_links_resolve() -> None:
    for page in PAGES + [ROOT / "examples" / "README.md", ROOT / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path = (page.parent / target).resolve()
            if str(path.relative_to(ROOT)) in LINK_SLOTS:
                continue
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


# ---------------------------------------------------------------------------------------
# running them (the default model)


PYTHON_PAGES = [p for p in PAGES if any(b.page == p and b.lang == "python" and b.runs for b in ALL)]


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, shared_engine) -> None:
    page_blocks = [b for b in ALL if b.page == page]
    namespace: dict = {"__name__": "__docs__"}
    ran, printed = 0, None
    for b in page_blocks:
        if b.lang == "text" and "output" in b.flags:
            assert printed is not None and printed.strip() == b.code.strip(), (
                f"{b.where}: the page shows\n{b.code}\nbut the block before it printed\n{printed}"
            )
        if b.lang != "python" or not b.runs:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(b.code, b.where, "exec", dont_inherit=True), namespace)
            except Exception as e:
                raise AssertionError(f"{b.where} failed: {type(e).__name__}: {e}\n{out.getvalue()[-2000:]}") from e
        printed, ran = out.getvalue(), ran + 1
    assert ran == sum(b.lang == "python" and b.runs for b in page_blocks)


SHELL_RUNS = [
    (b, argv)
    for b in ALL
    if b.lang in SHELL and b.runs
    for argv in commands(b)
    if argv[0] == "constrained-serve" and argv[1] in ("generate", "info")
]


@pytest.mark.slow
@pytest.mark.parametrize("block,argv", SHELL_RUNS, ids=[f"{b.where}:{a[1]}" for b, a in SHELL_RUNS])
def test_shell_commands_run(block: Block, argv: list[str], shared_engine, capsys) -> None:
    from constrained_serve.cli.command import main

    assert main(argv[1:], engine=shared_engine) == 0, f"{block.where}: {shlex.join(argv)}\n{capsys.readouterr().err}"
    assert capsys.readouterr().out.strip()
