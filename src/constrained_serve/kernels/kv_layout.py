"""Memory layout of the KV page pool, and gathers of a batch's pages out of it.

Every consumer indexes one layer's pool as ``[num_pages, page_size, num_kv_heads, head_dim]``
(attention.py). The storage behind that shape is either

- contiguous ``[P, ps, Hkv, D]`` (GPU: the Triton kernels want it), or
- head-major ``[Hkv, P, ps, D]`` seen through a permuted view (CPU). The torch attention
  gathers the pages of the rows it attends; head-major storage makes that gather come out as
  ``[Hkv, rows, keys, D]``, contiguous per head, which is the operand layout of a batched
  GEMM. From the contiguous layout the same gather needs an extra transposing copy, and
  torch's fused CPU SDPA over the strided gather is 2-3x slower than the GEMMs for the short
  query lengths of decode rows.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch


def allocate_pool(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    head_major: bool,
) -> torch.Tensor:
    """One layer's zeroed K (or V) pool, shaped [P, ps, Hkv, D] in either storage order.

    On Linux CPUs the pool is an anonymous memory map: the kernel hands out zeroed memory as
    it is first written, so an engine starts without touching its whole pool (zeroing 1.5 GB
    on 2 MiB pages took 3-4 s of the default engine's start, most of it the kernel finding
    free 2 MiB pages), and memory no request has used stays unallocated."""
    shape = (
        (num_kv_heads, num_pages, page_size, head_dim) if head_major else (num_pages, page_size, num_kv_heads, head_dim)
    )
    numel = math.prod(shape)
    if device.type == "cpu" and sys.platform.startswith("linux") and numel:
        # The tensor keeps the map alive; it is unmapped with the tensor's storage.
        anon = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)  # private: shared maps get no huge pages
        pool = torch.frombuffer(anon, dtype=dtype, count=numel).view(shape)
        _advise_huge_pages(pool)  # before the first touch
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
    return pool.permute(1, 2, 0, 3) if head_major else pool


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for 2 MiB pages behind a CPU pool's memory map (allocate_pool, Linux only),
    before it is first touched. Attention reads pages scattered over the whole pool (every
    4 KiB KV page a different 4 KiB memory page otherwise), and the address translations add
    to every read: the native CPU decode attention took 44-46 instead of 50 ms a step with
    them (benchmarks/attention_bound.py --forms). Where the kernel's transparent huge pages
    are off ("never") this changes nothing."""
    if t.nbytes < 2 * _HUGE_PAGE:
        return
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def heads_view(cache: torch.Tensor) -> torch.Tensor | None:
    """[Hkv, P * ps, D] view of a head-major pool (slot-indexed per head); None otherwise."""
    p, ps, hkv, d = cache.shape
    phys = cache.permute(2, 0, 1, 3)
    if not phys.is_contiguous():
        return None
    return phys.view(hkv, p * ps, d)


def _buffer(buffers: dict, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    # Gather destinations are reused by every layer of a step: a fresh multi-MiB tensor per
    # layer costs page faults on each call (index_select into a reused buffer is ~1.5x faster).
    buf = buffers.get(name)
    if buf is None or buf.dtype != like.dtype or buf.shape != shape:
        buf = buffers[name] = like.new_empty(shape)
    return buf


def gather_heads(cache: torch.Tensor, pages: torch.Tensor, buffers: dict, name: str) -> torch.Tensor:
    """The keys (or values) of the given pages, in order, as [Hkv, len(pages) * ps, D],
    contiguous, into a buffer kept in ``buffers`` under ``name``."""
    p, ps, hkv, d = cache.shape
    n = pages.numel()
    heads = heads_view(cache)
    if heads is not None:
        out = _buffer(buffers, name, (hkv * n, ps * d), cache)
        # One dim-0 gather over every head's pages (index_select along dim 1 of the whole pool
        # is ~2.5x slower); the index, the same for K and V and every layer, is built once.
        cached = buffers.get(("heads index", id(pages)))
        if cached is None or cached[0] is not pages:
            index = (torch.arange(hkv, device=pages.device)[:, None] * p + pages).reshape(-1)
            cached = buffers[("heads index", id(pages))] = (pages, index)
        torch.index_select(heads.view(hkv * p, ps * d), 0, cached[1], out=out)
        return out.view(hkv, n * ps, d)
    rows = torch.index_select(cache, 0, pages, out=_buffer(buffers, name + "/rows", (n, ps, hkv, d), cache))
    out = _buffer(buffers, name, (hkv, n * ps, d), cache)
    out.copy_(rows.view(n * ps, hkv, d).transpose(0, 1))
    return out
