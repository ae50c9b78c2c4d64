"""Host work per decode step: the time a step spends outside the model forward, at 64 and 256
running requests, with and without grammars (issue #20's target: <= 2 ms per step at 256
rows unconstrained, <= 4 ms with 256 JSON-schema rows, on the GPU machine's host).

The model is made tiny (1 layer, 64 wide, a 512-token byte-level BPE vocabulary trained here)
so the forward costs next to nothing and what is left is the engine's own work: scheduling,
building the step's tensors, the grammar round trips, sampling, appending tokens and stop
checks. Each step is timed whole and its forward alone (``ModelRunner.forward``, synchronous
on CPU); only steady-state steps count (every request decoding, none prefilling), and the
figure is their median. With ``--pipeline`` (the default loop on CUDA) the host work of a
step runs while the GPU computes the step's forward, so a GPU step takes max(forward, host)
instead of their sum; on CPU it only reorders the work (and the masks, filled during the
forward in the plain loop, no longer are).

    python benchmarks/host_overhead.py [--rows 64 256] [--tokens 64] [--repeats 3] [--mask-workers N]
                                       [--profile [--profile-sort cumulative]] [--pipeline]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import save  # noqa: E402

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "tags", "note"],
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "note": {"type": "string", "maxLength": 400},
    },
}


def tiny_model(folder: Path, vocab: int = 512) -> Path:
    """A 1-layer, 64-wide Llama with a byte-level BPE tokenizer of ``vocab`` tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = (
        "the customer order parcel late broken screen refund invoice note tag json value name "
        "id list item text more about a of to and in"
    ).split()
    corpus = [
        " ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + ' {"id": 12, "tags": ["a"]}' for i in range(400)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    hf.save_pretrained(str(folder))
    cfg = LlamaConfig(
        vocab_size=len(hf),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=hf.eos_token_id,
        eos_token_id=hf.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


class StepTimer:
    """Wraps the engine core's step and the runner's forward to time both."""

    def __init__(self, engine) -> None:
        self.core = engine.core
        # (step s, forward s, sampling rows, tokens, s from the step's start to its forward's)
        self.steps: list[tuple[float, float, int, int, float]] = []
        self._fwd = 0.0
        self._t0 = self._before = 0.0
        self._shape = (0, 0)
        forward, step = self.core.runner.forward, self.core.step

        def timed_forward(inputs):
            t = time.perf_counter()
            self._before = t - self._t0
            out = forward(inputs)
            self._fwd += time.perf_counter() - t
            self._shape = (int(inputs.logits_indices.shape[0]), int(inputs.input_ids.shape[0]))
            return out

        def timed_step():
            self._fwd, self._shape, self._before = 0.0, (0, 0), 0.0
            t = self._t0 = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - t, self._fwd, *self._shape, self._before))
            return out

        self.core.runner.forward = timed_forward
        self.core.step = timed_step

    def steady(self, rows: int) -> list[float]:
        """Host ms of the steps where all ``rows`` requests decode one token each."""
        return [(s - f) * 1e3 for s, f, n, t, _ in self.steps if n == rows and t == rows]

    def before_forward(self, rows: int) -> list[float]:
        """Host ms of those steps before the forward is launched: scheduling and inputs (the
        rest reads the tokens, advances grammars, fills masks and samples)."""
        return [b * 1e3 for s, f, n, t, b in self.steps if n == rows and t == rows]


def run(engine, rows: int, tokens: int, constrained: bool, repeats: int, temperature: float = 0.0) -> dict:
    from constrained_serve import SamplingParams

    timer = StepTimer(engine)
    prompts = [f"Request {i}: the customer wrote a note about order {i}." for i in range(rows)]
    spec = {"schema": SCHEMA} if constrained else {}
    params = SamplingParams(max_tokens=tokens, ignore_eos=not constrained, temperature=temperature, seed=1)
    engine.generate(prompts[: min(8, rows)], params, **spec)  # warm up: compile, workers, allocations
    per_round, before, walls = [], [], []
    for _ in range(repeats):
        timer.steps.clear()
        t0 = time.perf_counter()
        results = engine.generate(prompts, params, **spec)
        walls.append(time.perf_counter() - t0)
        host = timer.steady(rows)
        if not host:
            raise RuntimeError(f"no steady decode step with {rows} rows (max_num_seqs too small?)")
        per_round.append(statistics.median(host))
        before.append(statistics.median(timer.before_forward(rows)))
        fwd = statistics.median([f * 1e3 for s, f, n, t, _ in timer.steps if n == rows and t == rows])
    out_tokens = sum(r.usage.completion_tokens for r in results)
    return {
        "rows": rows,
        "constrained": constrained,
        "host_ms_median": statistics.median(per_round),
        "host_ms_rounds": per_round,
        "before_forward_ms_median": statistics.median(before),
        "forward_ms_median": fwd,
        "steady_steps": len(timer.steady(rows)),
        "wall_s": statistics.median(walls),
        "output_tokens": out_tokens,
        "finish": {k: sum(r.finish_reason == k for r in results) for k in ("stop", "length", "abort")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--backend", default="llguidance", choices=["llguidance", "xgrammar"])
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy, as extraction runs (> 0 adds per-row seeded noise: on CPU ~7 us a row "
        "for its generator, in the Triton sampling kernel on GPU)",
    )
    ap.add_argument(
        "--mask-workers",
        type=int,
        default=None,
        help="grammar mask worker processes (default: the engine's, 1 on CPU; on CUDA up to 8)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the largest constrained run")
    ap.add_argument("--profile-sort", default="tottime", help="pstats order of --profile: tottime, cumulative, ...")
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="the pipelined loop (CUDA's default): on a GPU a step then takes max(forward, host), not their sum",
    )
    args = ap.parse_args()
    import torch

    from constrained_serve import Engine

    torch.set_num_threads(args.threads)
    folder = tiny_model(Path(tempfile.mkdtemp(prefix="host-overhead-")))
    biggest = max(args.rows)
    engine = Engine(
        model=str(folder),
        max_num_seqs=biggest,
        max_num_batched_tokens=max(512, 4 * biggest),
        kv_cache_tokens=biggest * (args.tokens + 64),
        grammar_backend=args.backend,
        grammar_mask_workers=args.mask_workers,
        pipeline=args.pipeline,
    )
    results = []
    print(
        f"host ms per steady decode step (step minus forward), median of {args.repeats} rounds; "
        f"{args.tokens} tokens per request, {engine.device}, pipelined loop {'on' if args.pipeline else 'off'}"
    )
    for constrained in (False, True):
        for rows in args.rows:
            r = run(engine, rows, args.tokens, constrained, args.repeats, args.temperature)
            results.append(r)
            print(
                f"  {rows:4d} rows {'JSON schema' if constrained else 'free text  '}: "
                f"host {r['host_ms_median']:6.2f} ms, {r['before_forward_ms_median']:5.2f} before the forward"
                f"  (forward {r['forward_ms_median']:5.2f} ms, {r['steady_steps']} steady steps, "
                f"rounds {', '.join(f'{x:.2f}' for x in r['host_ms_rounds'])})",
                flush=True,
            )
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        run(engine, biggest, args.tokens, True, 1, args.temperature)
        prof.disable()
        pstats.Stats(prof).sort_stats(args.profile_sort).print_stats(40)
    engine.grammar.close()
    print("saved", save("host_overhead", {"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
