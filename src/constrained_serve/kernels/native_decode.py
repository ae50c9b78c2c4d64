"""The CPU attention of a step's short rows through a small native kernel (paged_decode_cpu.c):
the decode rows, and the tokens of short chunks (grammar-forced tokens appended to a decoding
request, up to MAX_CHUNK of them), each token a row that sees the keys up to its own position.

torch has no paged attention on CPU: its path (short_rows.py) gathers each row's pages, then
runs batched GEMMs, and the decode rows' attention was 42% of a CPU decode round in fp32 (62%
in bf16) at about a quarter of the machine's read bandwidth (benchmarks/attention_bound.py).
The kernel reads the pages in place, once. It is compiled on first use with the system C
compiler (native_build.py).

Where it cannot run, the torch path does, with the same results up to float rounding: no C
compiler (logged once), ``CONSTRAINED_SERVE_NATIVE_ATTENTION=0``, a dtype other than fp32 and
bf16 (or q and the pool in different dtypes), a pool that is not head-major, or sizes past the
kernel's limits (GQA group 16, head_dim 256, page size 128).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .kv_layout import heads_view
from .native_build import NativeLibrary

if TYPE_CHECKING:
    from .attention_metadata import AttentionMetadata

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
ENV_SWITCH = "CONSTRAINED_SERVE_NATIVE_ATTENTION"
# -march=native: the library is built on the machine that runs it. -fopenmp links libgomp,
# which resolves to the copy torch has already loaded (same soname): one thread pool for both,
# and each call asks for torch.get_num_threads() threads. -ffast-math lets the compiler
# vectorize the dot products' sums and expf (the results stay within 1e-5 of float64).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
MAX_GROUP, MAX_DIM, MAX_PAGE = 16, 256, 128
# Chunks of up to this many tokens are attended here. Each token reads the chunk's pages again
# (from cache), so longer chunks are faster through the torch path's one gather and GEMMs
# (short_rows.py). Measured per call, 8 chunks, fp32, native against torch: 2 tokens 1.7-2.0x
# faster, 4 tokens 1.1-1.9x, 6 tokens 0.9-1.2x, 8 tokens 0.76-1.1x, 16 tokens 0.5-0.85x
# (SmolLM2-135M's heads over 300 and 1000 keys; Llama-3-8B's over 2000).
MAX_CHUNK = 4
# The kernel's instance for each dtype (q, the pool and the output share it).
_KERNELS = {torch.float32: "paged_rows_f32", torch.bfloat16: "paged_rows_bf16"}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _KERNELS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]
        fn.argtypes += [ctypes.c_float, ctypes.c_int]  # the scale, the threads
        fn.restype = ctypes.c_int


LIBRARY = NativeLibrary(SOURCE, CFLAGS, ENV_SWITCH, "CPU decode attention", _declare)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None where it is switched off or cannot
    be built (the reason is logged once)."""
    return LIBRARY.get()


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take this layer's short rows (and is available)."""
    _, page_size, hkv, d = k_cache.shape
    return (
        q.device.type == "cpu"
        and q.dtype in _KERNELS
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.stride(-1) == 1
        and q.stride(1) == d
        and q.shape[1] % hkv == 0
        and q.shape[1] // hkv <= MAX_GROUP
        and d <= MAX_DIM
        and page_size <= MAX_PAGE
        and heads_view(k_cache) is not None
        and heads_view(v_cache) is not None
        and library() is not None
    )


def _rows(meta: AttentionMetadata, num_pages: int, page_size: int) -> tuple[torch.Tensor, ...] | None:
    """The step's short rows, planned once per step: each token of a chunk of up to MAX_CHUNK
    tokens is a row, with its sequence, its token and the keys it sees (its position + 1), and
    the int32 block tables the kernel reads. Native code reads where the tables point,
    unchecked, so they are checked here: a page id out of the pool, or a sequence longer than
    its table, raises instead of reading foreign memory."""
    key = ("native rows", num_pages, page_size)
    if key not in meta.plan_cache:
        starts, qlens, lens = meta.query_starts_host, meta.query_lens_host, meta.seq_lens_host
        seqs = [b for b, n in enumerate(qlens) if n <= MAX_CHUNK]
        plan = None
        if seqs:
            tables = meta.block_tables.to(torch.int32).contiguous()
            longest = max(lens[b] for b in seqs)
            top = int(tables.max()) if tables.numel() else -1
            if longest > tables.shape[1] * page_size or top >= num_pages:
                raise RuntimeError(
                    f"block tables out of range for the native CPU attention: {tables.shape[1]} pages of "
                    f"{page_size} for {longest} keys, page ids up to {top} in a pool of {num_pages}"
                )
            # Token j of a chunk of n sits at position L - n + j: it sees L - n + j + 1 keys.
            row_seq = [b for b in seqs for _ in range(qlens[b])]
            row_tok = [starts[b] + j for b in seqs for j in range(qlens[b])]
            row_len = [lens[b] - qlens[b] + j + 1 for b in seqs for j in range(qlens[b])]
            plan = tuple(torch.tensor(x, dtype=torch.int64) for x in (row_seq, row_tok, row_len)) + (tables,)
        meta.plan_cache[key] = plan
    return meta.plan_cache[key]


def attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write the short rows' attention into ``out`` ([tokens, Hq, D]); ``supports`` first."""
    num_pages, page_size, hkv, d = k_cache.shape
    rows = _rows(meta, num_pages, page_size)
    if rows is None:
        return
    row_seq, row_tok, row_len, tables = rows
    k, v, lib = heads_view(k_cache), heads_view(v_cache), library()
    assert k is not None and v is not None and lib is not None
    assert out.dtype == q.dtype and out.stride(-1) == 1 and out.stride(1) == d
    rc = getattr(lib, _KERNELS[q.dtype])(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        num_pages,
        tables.data_ptr(),
        tables.stride(0),
        row_seq.data_ptr(),
        row_tok.data_ptr(),
        row_len.data_ptr(),
        row_seq.numel(),
        out.data_ptr(),
        out.stride(0),
        hkv,
        q.shape[1] // hkv,
        d,
        page_size,
        scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(
            f"native CPU attention refused its sizes: group {q.shape[1] // hkv}, head_dim {d}, page size {page_size}"
        )
