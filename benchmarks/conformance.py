"""JSONSchemaBench conformance of both grammar backends (MaskBench-style sample).

For every schema: compile (bounded by the manager's 10 s timeout); for those that compile,
feed each test instance, written as the engine's JSON mode writes it (compact, keys in the
schema's property order), through a fresh matcher with the default tokenizer.
valid -> must be accepted to completion; invalid -> must be rejected somewhere.

    python benchmarks/conformance.py [--limit N] [--backend NAME] [--write-baseline]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from constrained_serve.grammar.schema_walk import follow_local_refs

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "jsonschemabench"
BASELINE = ROOT / "tests" / "grammar" / "baseline_jsonschemabench.json"
BACKENDS = ("llguidance", "xgrammar")


def load_default_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from constrained_serve.models.loader import default_model_dir

    # The converted default model's tokenizer: the same one the engine uses, loaded in seconds.
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def split_of(name: str) -> str:
    """Split = file name prefix: 'Github---x.json' -> Github, 'BFCL_simple_3.json' -> BFCL."""
    if "---" in name:
        return name.split("---", 1)[0]
    return re.split(r"[_.]", name, maxsplit=1)[0]


def schema_files(limit: int | None = None) -> list[Path]:
    files = sorted(DATA.iterdir())
    return files[:limit] if limit else files


# -- serialization in schema property order --------------------------------------------
class _Validity:
    """Does a value match a sub-schema (refs resolved against the root)? Used to pick the
    anyOf/oneOf branch whose property order the engine would follow."""

    def __init__(self, root: Any):
        import jsonschema

        try:
            self._root = jsonschema.validators.validator_for(root)(root)
        except Exception:  # unusable root schema: fall back to "every branch"
            self._root = None

    def __call__(self, value: Any, schema: Any) -> bool:
        if self._root is None:
            return True
        try:
            return self._root.evolve(schema=schema).is_valid(value)
        except Exception:  # unresolvable refs and the like
            return True


def _branches(schema: Any, root: Any, value: Any, valid: _Validity, depth: int = 0) -> Iterator[dict]:
    """The schema and the sub-schemas whose properties apply to ``value``: every allOf
    branch, and the first anyOf/oneOf branch the value matches (all of them if none)."""
    schema = follow_local_refs(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return
    yield schema
    for key in ("allOf", "anyOf", "oneOf"):
        subs = schema.get(key)
        if not isinstance(subs, list):
            continue
        if key != "allOf":
            matching = [b for b in subs if valid(value, b)]
            subs = matching[:1] or subs
        for sub in subs:
            yield from _branches(sub, root, value, valid, depth + 1)


def order_like_schema(value: Any, schema: Any, root: Any, valid: _Validity | None = None) -> Any:
    """Reorder object keys to the schema's property order (both engines enforce it)."""
    valid = valid or _Validity(root)
    branches = list(_branches(schema, root, value, valid))
    if isinstance(value, dict):
        order: list[str] = []
        subs: dict[str, Any] = {}
        for b in branches:
            props = b.get("properties")
            if isinstance(props, dict):
                for k, s in props.items():
                    if k not in subs:
                        order.append(k)
                        subs[k] = s
        patterns = [
            (p, s)
            for b in branches
            if isinstance(b.get("patternProperties"), dict)
            for p, s in b["patternProperties"].items()
        ]
        extra_schema = next(
            (b["additionalProperties"] for b in branches if isinstance(b.get("additionalProperties"), dict)), None
        )

        def sub_for(k: str) -> Any:
            if k in subs:
                return subs[k]
            for p, s in patterns:
                try:
                    if re.search(p, k):
                        return s
                except re.error:
                    pass
            return extra_schema

        keys = [k for k in order if k in value] + [k for k in value if k not in subs]
        return {k: order_like_schema(value[k], sub_for(k), root, valid) for k in keys}
    if isinstance(value, list):
        out = []
        for i, v in enumerate(value):
            sub = None
            for b in branches:
                prefix = b.get("prefixItems")
                items = b.get("items")
                if isinstance(prefix, list) and i < len(prefix):
                    sub = prefix[i]
                elif isinstance(items, list) and i < len(items):
                    sub = items[i]
                elif isinstance(items, dict):
                    sub = items
                if sub is not None:
                    break
            out.append(order_like_schema(v, sub, root, valid))
        return out
    return value


def serialize(value: Any, schema: Any) -> str:
    return json.dumps(order_like_schema(value, schema, schema), separators=(",", ":"), ensure_ascii=False)


# -- evaluation --------------------------------------------------------------------------
def evaluate(manager: Any, backend: str, files: list[Path], tokenizer: Any) -> dict[str, dict]:
    from constrained_serve.errors import GrammarError
    from constrained_serve.grammar import make_output_spec

    results: dict[str, dict] = {}
    for path in files:
        doc = json.loads(path.read_text())
        tests = doc.get("tests", [])
        r: dict[str, Any] = {
            "compiled": False,
            "valid_total": sum(1 for t in tests if t["valid"]),
            "invalid_total": sum(1 for t in tests if not t["valid"]),
            "valid_accepted": 0,
            "invalid_rejected": 0,
        }
        t0 = time.perf_counter()
        try:
            # The corpus's valid instances may carry keys the schema does not declare: the
            # schema is read literally (open objects), not closed as the engine's default does.
            spec = make_output_spec(schema=doc["schema"], json_open_objects=True)
            manager.compile(spec, backend)
        except ValueError as e:  # GrammarError is a ValueError
            r["error"] = str(e)[:300]
        else:
            r["compiled"] = True
            r["compile_s"] = round(time.perf_counter() - t0, 4)
            for t in tests:
                text = serialize(t["data"], doc["schema"])
                ids = tokenizer.encode(text, add_special_tokens=False)
                # Compiled again (a cache hit) per instance: a matcher that broke its grammar
                # (llguidance's lexer limit) evicts it, and the next instance gets a fresh one.
                m = manager.new_matcher(manager.compile(spec, backend))
                try:
                    ok = m.accept_tokens(ids) and m.can_end()
                except GrammarError:  # the backend failed on this instance
                    ok = False
                if t["valid"]:
                    r["valid_accepted"] += int(ok)
                else:
                    r["invalid_rejected"] += int(not ok)
        results[path.name] = r
    return results


def summarize(results: dict[str, dict[str, dict]]) -> str:
    lines = []
    for backend, per_file in results.items():
        by_split: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for name, r in per_file.items():
            for key in ("all", split_of(name)):
                c = by_split[key]
                c["schemas"] += 1
                c["compiled"] += int(r["compiled"])
                c["valid_total"] += r["valid_total"]
                c["invalid_total"] += r["invalid_total"]
                if r["compiled"]:
                    c["v_tot_c"] += r["valid_total"]
                    c["i_tot_c"] += r["invalid_total"]
                    c["valid_accepted"] += r["valid_accepted"]
                    c["invalid_rejected"] += r["invalid_rejected"]
        lines.append(f"== {backend}: compiled | valid accepted (of compiled; of all) | invalid rejected (of compiled)")
        for key in ["all"] + sorted(k for k in by_split if k != "all"):
            c = by_split[key]
            pct = lambda a, b: f"{100 * a / b:5.1f}%" if b else "   n/a"  # noqa: E731
            lines.append(
                f"{key:>16}: {c['compiled']:4d}/{c['schemas']:<4d} {pct(c['compiled'], c['schemas'])} | "
                f"{c['valid_accepted']:4d}/{c['v_tot_c']:<4d} {pct(c['valid_accepted'], c['v_tot_c'])}; "
                f"{pct(c['valid_accepted'], c['valid_total'])} | "
                f"{c['invalid_rejected']:4d}/{c['i_tot_c']:<4d} {pct(c['invalid_rejected'], c['i_tot_c'])}"
            )
    return "\n".join(lines)


def _run_backend(args: tuple[str, int | None]) -> tuple[str, dict, float]:
    """One backend in one process: its own tokenizer and manager (2 cores: one each)."""
    backend, limit = args
    import torch

    torch.set_num_threads(1)
    from constrained_serve.grammar import GrammarManager

    tok = load_default_tokenizer()
    manager = GrammarManager(tok, len(tok), default_backend=backend, max_workers=1, cache_size=8)
    manager.warm_up(backend).result()
    t0 = time.perf_counter()
    res = evaluate(manager, backend, schema_files(limit), tok)
    manager.close()
    return backend, res, time.perf_counter() - t0


def run_all(backends: tuple[str, ...] = BACKENDS, limit: int | None = None, processes: bool = True) -> dict:
    """{backend: {file: result}}; backends run in parallel processes when asked."""
    jobs = [(b, limit) for b in backends]
    if processes and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a fork of a process that already runs llguidance/xgrammar threads is unsafe.
        with ProcessPoolExecutor(len(jobs), mp_context=mp.get_context("spawn")) as ex:
            out = list(ex.map(_run_backend, jobs))
    else:
        out = [_run_backend(j) for j in jobs]
    for backend, _, secs in out:
        print(f"{backend}: evaluated in {secs:.1f} s", file=sys.stderr)
    return {b: r for b, r, _ in out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="only the first N schema files")
    ap.add_argument("--backend", choices=BACKENDS, action="append", help="default: both")
    ap.add_argument("--write-baseline", action="store_true", help=f"write {BASELINE.relative_to(ROOT)}")
    ap.add_argument("--serial", action="store_true", help="one process for all backends")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = run_all(tuple(args.backend or BACKENDS), args.limit, processes=not args.serial)
    print(summarize(results))
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.write_baseline:
        BASELINE.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"wrote {BASELINE}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
