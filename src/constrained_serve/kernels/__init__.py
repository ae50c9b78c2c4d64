"""Kernels: each Triton kernel sits next to a plain torch reference with the same signature.

- attention.py: store_kv_torch, paged_attention_torch, and the Triton ones from
  attention_triton.py (varlen mixed batch, GQA), decode_split_triton.py (split-KV decode) and
  attention_tile_triton.py (the tile both share). The torch path's plans: short_rows.py (decodes,
  forced chunks, shared-prefix pages), long_chunks.py (prefill chunks); kv_layout.py: the
  pool's storage order (head-major on CPU) and page gathers; masking.py: the causal masks and
  fp32 masked softmax both plans use.
- sampling.py: apply_bitmask_{torch,triton}, sample_{torch,triton} (fused mask, temperature,
  top-k/top-p/min-p, seeded Gumbel draw).
- dispatch.py: picks Triton on CUDA, the references elsewhere (CONSTRAINED_SERVE_KERNELS).
- onednn.py: oneDNN matmuls on CPU (the prepacked projections and the per-head prefill attention).

Triton is optional: without it every ``*_triton`` raises and dispatch uses the references.
It is imported where a Triton kernel first runs (attention.py and sampling.py resolve their
``*_triton`` names on first use): the CPU path never pays its 0.3 s import.
On CPU the Triton kernels run under TRITON_INTERPRET=1 (that is how the tests check them).
"""
