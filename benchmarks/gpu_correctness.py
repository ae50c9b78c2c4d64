"""Correctness of the engine against HF transformers on the same weights, greedy, token for token.

Random weights of the usual small scale give near-flat logits, where any rounding flips the
argmax and a match rate says nothing. Here every weight matrix is drawn with std ``--std``
(0.2 by default), so the logits have real gaps; the model is saved as a checkpoint and
loaded by the engine through its normal path. The engine runs with what a server runs with:
chunked prefill (a small token budget), preemption (a KV pool too small for all requests at
once), the prefix cache (half the prompts share a prefix of several pages), and the shape's
own rope scaling (llama3 for the Llama-3 configs). HF ``generate`` runs the same prompts
(equal lengths, so no padding) in one batch.

Constrained requests are compared too, for both grammar backends: HF gets a logits processor
that applies the same grammar through a GrammarManager, step by step (it cannot take the
engine's forced-token shortcut, so the engine runs with ``fast_forward=False`` there).

Pass/fail: every sequence equal in float32; at least 95% equal in bfloat16 (the kernels
round differently). Runs on CPU at small shapes (``--config tiny-llama``, the default on a
machine without CUDA) and on a GPU with the real shapes:

    python benchmarks/gpu_correctness.py [--config llama-3.2-1b] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT / "src"))

from gpu_e2e import config_path  # noqa: E402

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
}
TEXT = (
    "The support ticket says the parcel arrived late and the box was damaged; the customer asks "
    "for a refund and a new delivery date. Another message mentions a broken laptop screen, a "
    "missing invoice and a password that cannot be reset. "
) * 8


def default_tokenizer_dir() -> Path:
    from constrained_serve.models.loader import default_model_dir

    return Path(default_model_dir())


def build_checkpoint(config_file: Path, tokenizer_dir: Path, dest: Path, std: float, dtype) -> tuple:
    """A random HF Llama with every matrix ~ N(0, std), saved with the tokenizer; returns (model, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg_dict = json.loads(config_file.read_text())
    cfg_dict.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id or 0, eos_token_id=tok.eos_token_id)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg_dict))
    cfg = AutoConfig.from_pretrained(str(dest))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model = model.to(dtype)
    model.save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    return model, tok


def prompts(tok, n: int, length: int, shared: int) -> list[list[int]]:
    """n prompts of exactly ``length`` tokens; the even ones share their first ``shared``."""
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    out = []
    for i in range(n):
        if i % 2 == 0:
            p = ids[:shared] + ids[shared + 3 * i : shared + 3 * i + length - shared]
        else:
            p = ids[5 * i : 5 * i + length]
        assert len(p) == length, "the sample text is too short for these lengths"
        out.append(p)
    return out


class GrammarProcessor:
    """A transformers LogitsProcessor applying one grammar per row (our GrammarManager)."""

    def __init__(self, manager, compiled, rows: int, prompt_len: int):
        self.m = manager
        self.handles = [manager.new_matcher(compiled) for _ in range(rows)]
        self.prompt_len = prompt_len
        self.done = [False] * rows

    def __call__(self, input_ids, scores):
        from constrained_serve.kernels.sampling import unpack_bitmask

        n = input_ids.shape[1] - self.prompt_len
        for i, h in enumerate(self.handles):
            if n and not self.done[i]:
                tok = int(input_ids[i, -1])
                if tok in self.m.eos_token_ids:
                    self.done[i] = True
                else:
                    [a] = self.m.advance([(h, [tok], 0, ())])
                    assert a is not None and a.accepted, f"row {i}: HF picked a token its grammar refuses"
        bitmask = self.m.allocate_bitmask(len(self.handles))
        live = [(i, h) for i, h in enumerate(self.handles) if not self.done[i]]
        if live:
            self.m.fill_bitmask(live, bitmask)
        allowed = unpack_bitmask(bitmask, scores.shape[-1]).to(scores.device)
        return scores.masked_fill(~allowed, float("-inf"))


def hf_generate(model, rows: list[list[int]], max_new: int, device, processor=None) -> list[list[int]]:
    import torch
    from transformers import LogitsProcessorList

    ids = torch.tensor(rows, device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=None if processor is None else model.config.eos_token_id,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([processor] if processor else []),
        )
    result = []
    for row in out[:, ids.shape[1] :].tolist():
        if processor is not None and model.config.eos_token_id in row:
            # The engine ends a request once its grammar allows nothing but EOS (without a
            # step to sample it); HF samples the EOS.
            row = row[: row.index(model.config.eos_token_id)]
        result.append(row)
    return result


def compare(name: str, ours: list[list[int]], theirs: list[list[int]], report: dict) -> float:
    equal = sum(a == b for a, b in zip(ours, theirs))
    first = sum(a[:1] == b[:1] for a, b in zip(ours, theirs))
    diverge = [
        next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(ours, theirs)
        if a != b
    ]
    rate = equal / len(ours)
    report[name] = {
        "sequences": len(ours),
        "equal": equal,
        "rate": rate,
        "first_token_equal": first,
        "first_divergence_positions": diverge[:16],
    }
    print(
        f"{name:<28} {equal}/{len(ours)} sequences equal ({rate:.1%}); first token {first}/{len(ours)}"
        + (f"; diverge at {diverge[:8]}" if diverge else ""),
        flush=True,
    )
    return rate


def run(args: argparse.Namespace) -> dict:
    import torch

    from constrained_serve import Engine, SamplingParams
    from constrained_serve.grammar import GrammarManager, make_output_spec

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    report: dict = {
        "config": args.config,
        "dtype": args.dtype,
        "device": device,
        "std": args.std,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        hf, tok = build_checkpoint(
            config_path(args.config), Path(args.tokenizer or default_tokenizer_dir()), folder, args.std, dtype
        )
        hf = hf.to(device).eval()
        report["build_s"] = round(time.perf_counter() - t0, 1)
        page = 16
        rows = prompts(tok, args.num_requests, args.prompt_len, shared=4 * page)
        # Room for about half the requests at full length: the rest wait or get preempted.
        kv_tokens = max(4 * page, (args.num_requests // 2) * (args.prompt_len + args.output_len))
        common = dict(
            model=str(folder),
            dtype=args.dtype,
            device=device,
            page_size=page,
            max_num_seqs=args.num_requests,
            max_num_batched_tokens=args.chunk,
            kv_cache_tokens=kv_tokens,
        )
        eng = Engine(**common)
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        ours = [r.token_ids for r in eng.generate(rows, params)]
        report["engine_paths"] = {"preemptions": eng.core.scheduler.num_preemptions, "cached_prompt_tokens": None}
        again = eng.generate(rows, params)  # now from the prefix cache
        report["engine_paths"]["cached_prompt_tokens"] = sum(r.usage.cached_tokens for r in again)
        report["engine_paths"]["equal_with_cache"] = all(a.token_ids == b for a, b in zip(again, ours))
        graphs = eng.core.runner.graphs
        report["engine_paths"]["graph_replays"] = graphs.replays if graphs is not None else None
        if graphs is not None:  # the same requests decoded eagerly: graphs must not change a token
            eager = Engine(**common, cuda_graphs=False)
            eager_ids = [r.token_ids for r in eager.generate(rows, params)]
            same = sum(a == b for a, b in zip(eager_ids, ours)) / len(ours)
            report["engine_paths"]["equal_without_graphs"] = same
            del eager
        print(f"engine: {report['engine_paths']}", flush=True)
        theirs = hf_generate(hf, rows, args.output_len, device)
        rates = [compare("unconstrained", ours, theirs, report)]
        if not args.skip_grammar:
            n = min(args.num_requests, 8)
            for backend in ("llguidance", "xgrammar"):
                e2 = Engine(**common, fast_forward=False, grammar_backend=backend)
                got = [
                    r.token_ids
                    for r in e2.generate(rows[:n], SamplingParams(max_tokens=args.output_len), schema=SCHEMA)
                ]
                gm = GrammarManager(
                    tok,
                    e2.vocab_size,
                    default_backend=backend,
                    isolation="inline",
                    eos_token_ids=sorted(e2.core.eos_token_ids),
                )
                proc = GrammarProcessor(gm, gm.compile(make_output_spec(schema=SCHEMA)), n, args.prompt_len)
                want = hf_generate(hf, rows[:n], args.output_len, device, proc)
                rates.append(compare(f"JSON schema, {backend}", got, want, report))
                gm.close()
                e2.grammar.close()
            # Fast-forward on (the default): forced tokens join the next step as short chunks,
            # which the pipelined loop and the CUDA graphs (unrolled) take. HF cannot follow
            # here (its processor samples forced tokens one by one, and may split them
            # differently), so the reference is the same engine, plain loop, eager.
            fast = Engine(**common, pipeline=True)
            plain = Engine(**common, pipeline=False, cuda_graphs=False)
            spec = SamplingParams(max_tokens=args.output_len)
            a = [r.token_ids for r in fast.generate(rows[:n], spec, schema=SCHEMA)]
            b = [r.token_ids for r in plain.generate(rows[:n], spec, schema=SCHEMA)]
            g = fast.core.runner.graphs
            report["engine_paths"]["constrained_unrolled_graph_steps"] = g.unrolled if g is not None else None
            report["engine_paths"]["constrained_pipelined_graphs_vs_plain_eager"] = sum(
                x == y for x, y in zip(a, b)
            ) / len(a)
            rates.append(report["engine_paths"]["constrained_pipelined_graphs_vs_plain_eager"])
            print(f"constrained, fast-forward: {report['engine_paths']}", flush=True)
            fast.grammar.close()
            plain.grammar.close()
        eng.core.grammar.close() if eng.core.grammar is not None else None
    need = 1.0 if args.dtype == "float32" else 0.95
    rates.append(report["engine_paths"].get("equal_without_graphs", 1.0))
    report["pass"] = all(r >= need for r in rates) and report["engine_paths"]["equal_with_cache"]
    report["required_rate"] = need
    return report


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--config", default="llama-3.2-1b" if cuda else "tiny-llama")
    ap.add_argument(
        "--tokenizer",
        default=os.environ.get("CS_TOKENIZER_DIR"),
        help="tokenizer folder (default: the default model's)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--std", type=float, default=0.2, help="std of every weight matrix")
    ap.add_argument("--num-requests", type=int, default=32 if cuda else 8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=32 if cuda else 16)
    ap.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens: forces chunked prefill")
    ap.add_argument("--skip-grammar", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    for path in [args.json] + (
        [str(Path(os.environ["OUT"]) / f"gpu_correctness-{args.config}-{args.dtype}.json")]
        if os.environ.get("OUT")
        else []
    ):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    print("correctness:", "PASS" if report["pass"] else "FAIL")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
