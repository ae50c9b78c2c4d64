"""examples/quickstart.ipynb executes top to bottom (nbclient, a real kernel) and shows
what each section promises."""

from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient

from ..helpers import EXAMPLES, subprocess_env

pytestmark = pytest.mark.slow


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/html", "") + out.data.get("text/plain", ""))
    return "".join(parts)


def test_quickstart_notebook_runs(monkeypatch) -> None:
    nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = "MAX_TOKENS = 160\nBATCH_ROWS = 4\n"
    for k, v in subprocess_env().items():  # the kernel inherits this process's environment
        monkeypatch.setenv(k, v)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}).execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        assert not any(o.output_type == "error" for o in c.outputs), c.source
    text = {i: outputs_text(c) for i, c in enumerate(code)}
    by_source = {c.source.split("\n")[0]: outputs_text(c) for c in code}

    pydantic_html = next(t for t in text.values() if "constrained-serve-result" in t)
    assert "Invoice" in pydantic_html or "truncated" in pydantic_html
    parsed_cell = (
        "invoice.parsed  # an Invoice instance; None when the output is incomplete or refused (invoice.error says why)"
    )
    assert "Invoice(" in by_source[parsed_cell]
    assert len(re.findall(r"matches: True", "".join(text.values()))) == 2
    assert "model wrote:" in "".join(text.values()) and "start" in "".join(text.values())
    assert len(re.findall(r"(\d+) from cache", "".join(text.values()))) == 2
    assert re.search(r"\b[2-4]/4 valid", "".join(text.values()))
    assert "<table>" in list(text.values())[-1]
