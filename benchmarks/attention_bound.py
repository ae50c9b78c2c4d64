"""How much of a CPU decode round the attention takes, and what a one-pass kernel could gain.

The workload of `vs_vllm_cpu.py` (64 chats, 96 tokens each, greedy, fp32 or --dtype bfloat16, 2 threads, warm
prefix cache), with `ignore_eos` so that every round does the same work. Rounds alternate:

- "real": the engine as users get it;
- "no attention": the same engine with the paged attention replaced by a copy of the query
  (every other operation, the KV writes included, unchanged; the text is garbage, the work
  per token the same). The difference is what the attention costs a round.

Then the bound: the KV bytes a one-pass kernel must read in a round (every decode step reads
its row's whole context, K and V, every layer), over this machine's streaming read bandwidth
(a 1 GiB `sum`), added to the "no attention" time. That is what a paged-attention kernel that
reads the pages in place at full bandwidth would give; torch has none on CPU (see RESULTS.md).

With --forms, also one decode step's attention in isolation (30 layers, 64 rows x 256 keys,
3 KV heads of 64, GQA 3, in --dtype, pages scattered in a pool as the engine's): the torch path's
form (page gather, then two batched GEMMs), the same GEMMs over per-row contiguous K/V (no
gather: the best any layout gives torch's GEMMs), SDPA over those, the native kernel reading
the pages in place (native_decode.py), and a plain read of the same bytes.

Since the native kernel, "real" is the engine with it; CONSTRAINED_SERVE_NATIVE_ATTENTION=0
measures the torch path.

    python benchmarks/attention_bound.py [--repeats 3] [--n 64] [--max-tokens 96] [--forms]
                                         [--dtype float32|bfloat16]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests.kernel.helpers: the batch builder
from common import chat_workload, engine_parser, median, per_round, read_bandwidth_gbs, save, timed  # noqa: E402

import constrained_serve.kernels.dispatch as dispatch  # noqa: E402
from constrained_serve import Engine, SamplingParams  # noqa: E402
from constrained_serve.kernels import native_decode  # noqa: E402
from constrained_serve.kernels.kv_layout import allocate_pool, gather_heads  # noqa: E402
from tests.kernel.helpers import make_batch  # noqa: E402


def torch_forms(
    dtype=torch.float32, layers=30, rows=64, pages=16, page=16, hkv=3, group=3, d=64, pool_pages=2049
) -> dict[str, float]:
    """ms per decode step of each form of the attention (see the docstring), medians of 5."""
    g = torch.Generator().manual_seed(0)
    n_keys, b = pages * page, hkv * rows
    # The engine's pools (head-major, on huge pages) and a step's metadata: random distinct pages.
    pools = [
        [allocate_pool(pool_pages, page, hkv, d, dtype, torch.device("cpu"), head_major=True) for _ in range(2)]
        for _ in range(layers)
    ]
    for kc, vc in pools:
        kc.normal_(generator=g), vc.normal_(generator=g)
    meta = make_batch([1] * rows, [n_keys] * rows, page, pool_pages, g, pad_pages=0)
    row_pages = meta.block_tables.long().reshape(-1)
    k_rows = [torch.randn(b, n_keys, d, generator=g).to(dtype) for _ in range(layers)]
    v_rows = [torch.randn(b, n_keys, d, generator=g).to(dtype) for _ in range(layers)]
    q = torch.randn(b, group, d, generator=g).to(dtype)
    bias = torch.zeros(b, group, n_keys, dtype=dtype)
    buffers: dict = {}

    def gemms(k, v):
        return torch.bmm(torch.baddbmm(bias, q, k.transpose(1, 2), alpha=d**-0.5).softmax(-1), v)

    def gathered():  # the torch path's gather (kv_layout.gather_heads), then its two GEMMs
        for kc, vc in pools:
            gemms(
                gather_heads(kc, row_pages, buffers, "k").view(b, n_keys, d),
                gather_heads(vc, row_pages, buffers, "v").view(b, n_keys, d),
            )

    def contiguous():
        for k, v in zip(k_rows, v_rows):
            gemms(k, v)

    def sdpa():
        qs = q.view(hkv, rows, group, d).transpose(0, 1)
        for k, v in zip(k_rows, v_rows):
            kv = (x.view(hkv, rows, n_keys, d).transpose(0, 1) for x in (k, v))
            torch.nn.functional.scaled_dot_product_attention(qs, *kv)

    def read():
        for k, v in zip(k_rows, v_rows):
            k.sum(), v.sum()

    q_tokens = torch.randn(rows, hkv * group, d, generator=g).to(dtype)
    out_tokens = torch.empty_like(q_tokens)

    def native():
        for kc, vc in pools:
            native_decode.attend_rows(q_tokens, kc, vc, meta, d**-0.5, out_tokens)

    forms = [("gather_then_gemms", gathered), ("contiguous_gemms", contiguous), ("contiguous_sdpa", sdpa)]
    if native_decode.supports(q_tokens, *pools[0]):
        forms.append(("native_in_place", native))
    out = {}
    with torch.inference_mode():
        for name, fn in forms:
            fn()
            out[name] = median([timed(fn)[0] for _ in range(5)]) * 1e3
        read()
        out["read_only"] = median([timed(read)[0] for _ in range(5)]) * 1e3
    gb = layers * 2 * b * n_keys * d * dtype.itemsize / 1e9
    for name, ms in out.items():
        print(f"  {name:<18} {ms:6.1f} ms a step ({gb / ms * 1e3:5.1f} GB/s of KV)")
    return out


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=64, max_tokens=96, dtype=True)
    ap.add_argument("--forms", action="store_true", help="also time the attention's forms in isolation")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    forms = torch_forms(dtype) if args.forms else None
    convs = chat_workload(args.n)
    engine = Engine(model=args.model, num_threads=args.threads, max_num_seqs=max(64, args.n), dtype=dtype)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    real = dispatch.paged_attention

    def query_copy(q, k_cache, v_cache, meta, scale):
        return q.clone()

    def go():
        rs = engine.chat(convs, params)
        return sum(r.usage.completion_tokens for r in rs), [r.usage.prompt_tokens for r in rs]

    _, prompt_lens = go()  # warm-up: first-call allocations, the prefix cache filled
    runs: dict[str, list[float]] = {"real": [], "no_attention": []}
    tokens = 0
    try:
        for k in range(args.repeats):
            for name, fn in (("real", real), ("no_attention", query_copy)):
                dispatch.paged_attention = fn
                t, (tokens, _) = timed(go)
                runs[name].append(t)
                print(f"  round {k + 1}: {name:<13} {t:6.2f} s  {tokens / t:6.1f} tokens/s", flush=True)
    finally:
        dispatch.paged_attention = real

    arch = engine.model.arch
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * engine.dtype.itemsize
    # Decode step i of a row reads its prompt and the i tokens it has written.
    token_steps = sum(p + i for p in prompt_lens for i in range(args.max_tokens))
    kv_gb = token_steps * kv_bytes_per_token / 1e9
    bandwidth = read_bandwidth_gbs()
    t_real, t_none = median(runs["real"]), median(runs["no_attention"])
    one_pass_s = kv_gb / bandwidth
    bound_s = t_none + one_pass_s
    result = {
        "args": vars(args),
        "output_tokens": tokens,
        "real_s": t_real,
        "no_attention_s": t_none,
        "attention_s": t_real - t_none,
        "attention_share": (t_real - t_none) / t_real,
        "ratio_no_attention": per_round(runs["real"], runs["no_attention"]),
        "kv_read_gb": kv_gb,
        "read_bandwidth_gbs": bandwidth,
        "attention_effective_gbs": kv_gb / (t_real - t_none),
        "one_pass_attention_s": one_pass_s,
        "bound_s": bound_s,
        "bound_tokens_per_s": tokens / bound_s,
        "real_tokens_per_s": tokens / t_real,
        "runs": runs,
        "forms_ms_per_step": forms,
    }
    print(
        f"attention: {t_real - t_none:.2f} s of {t_real:.2f} s a round ({result['attention_share'] * 100:.0f}%), "
        f"reading {kv_gb:.1f} GB of KV at {result['attention_effective_gbs']:.1f} GB/s effective"
    )
    print(
        f"one pass at the machine's read bandwidth ({bandwidth:.1f} GB/s): {one_pass_s:.2f} s -> "
        f"{bound_s:.2f} s a round, {tokens / bound_s:.0f} tokens/s ({t_real / bound_s:.2f}x today's "
        f"{tokens / t_real:.0f})"
    )
    print("saved", save("attention_bound" + ("" if args.dtype == "float32" else f"-{args.dtype}"), result))


if __name__ == "__main__":
    main()
