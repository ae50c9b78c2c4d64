"""Conformance against real schema corpora (read from <project root>/../shared/data, never copied).

JSONSchemaBench: recomputed for both backends and compared with the committed baseline
(``benchmarks/conformance.py --write-baseline``): any regression fails. JSON-Schema-Test-Suite:
every schema compiles or is refused with GrammarError, within the compile bound.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import GrammarManager, make_output_spec

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
BACKENDS = ("llguidance", "xgrammar")

pytestmark = pytest.mark.slow


def _conformance_module():
    # A plain import (not from a file spec): the spawned worker processes re-import it by
    # name, and spawn hands them this sys.path.
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import conformance

    return conformance


def _require_shared(name: str) -> None:
    """Missing shared corpora fail the test with a message; they are never a skip."""
    if not (SHARED / name).is_dir():
        pytest.fail(f"shared data {SHARED / name} is missing (the repo's ../shared/data)")


def test_jsonschemabench_no_regression():
    _require_shared("jsonschemabench")
    conf = _conformance_module()
    baseline = json.loads(conf.BASELINE.read_text())
    t0 = time.perf_counter()
    # Both backends from this process, one after the other: the work runs in each manager's
    # grammar workers, so this process mostly waits. (Spawning a process per backend saved
    # wall time alone on 2 cores, but cost ~12 s of CPU in imports the other test worker needed.)
    results = conf.run_all(BACKENDS, processes=False)
    elapsed = time.perf_counter() - t0
    print(conf.summarize(results))
    regressions = []
    for backend in BACKENDS:
        assert set(results[backend]) == set(baseline[backend]), "schema set changed: rewrite the baseline"
        for name, base in baseline[backend].items():
            now = results[backend][name]
            if base["compiled"] and not now["compiled"]:
                regressions.append(f"{backend} {name}: no longer compiles: {now.get('error')}")
            elif now["compiled"]:
                for key in ("valid_accepted", "invalid_rejected"):
                    if now[key] < base[key]:
                        regressions.append(f"{backend} {name}: {key} {now[key]} < baseline {base[key]}")
    assert not regressions, "\n".join(regressions)
    # the llguidance targets of the project (over compiled schemas)
    ll = results["llguidance"].values()
    valid = sum(r["valid_accepted"] for r in ll if r["compiled"]) / sum(r["valid_total"] for r in ll if r["compiled"])
    invalid = sum(r["invalid_rejected"] for r in ll if r["compiled"]) / sum(
        r["invalid_total"] for r in ll if r["compiled"]
    )
    assert valid >= 0.95 and invalid >= 0.95, (valid, invalid)
    assert elapsed < 240, f"conformance took {elapsed:.0f} s (budget 240 s)"


def _suite_schemas():
    out = []
    for path in sorted((SHARED / "json-schema-test-suite" / "tests" / "draft2020-12").glob("*.json")):
        for i, group in enumerate(json.loads(path.read_text())):
            out.append((f"{path.stem}[{i}]", group["schema"]))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_test_suite_compiles_or_refuses(tokenizer, backend):
    _require_shared("json-schema-test-suite")
    schemas = _suite_schemas()
    assert len(schemas) > 100
    mgr = GrammarManager(tokenizer, 49152, default_backend=backend, max_workers=1)
    compiled = refused = 0
    try:
        for name, schema in schemas:
            t0 = time.perf_counter()
            try:
                spec = make_output_spec(schema=schema)
                mgr.compile(spec)
                compiled += 1
            except GrammarError:
                refused += 1
            # the manager's bound is 10 s; a little slack for a busy machine
            assert time.perf_counter() - t0 < 12, f"{backend} took too long on {name}"
    finally:
        mgr.close()
    print(f"{backend}: {compiled} compiled, {refused} refused of {len(schemas)}")
    assert compiled > 0
