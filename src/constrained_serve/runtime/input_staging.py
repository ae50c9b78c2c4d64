"""A step's inputs reach the device in one copy per dtype (int64, int32; float32 for sampling).

The runner's ``prepare`` builds a step's inputs as Python lists (token ids, positions, KV
slots, logits rows; query starts, context lengths, block tables). One tensor per list would
cost a host allocation and a host-to-device copy each, and a copy from pageable memory makes
the CPU wait for it. Instead each dtype's lists go, back to back, into one persistent host
buffer (pinned on CUDA, so the copy is asynchronous), then into one persistent device buffer;
the step's tensors are views of it. On CPU the host buffer is the device buffer: no copy.

The host buffers come in a pair, used in turn. A step's copy may still be queued when the
next step is prepared (the engine's pipelined loop prepares step N+1 before it reads step N's
tokens); it is done by the step after, because reading step N's tokens on the host waits for
everything queued before them, step N's copy included.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch


class _Staging:
    """One dtype's two host buffers (pinned on CUDA) and device buffer, grown on demand."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 4096) -> None:
        self.dtype = dtype
        self.device = device
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self.hosts = [torch.empty(capacity, dtype=self.dtype, pin_memory=pin) for _ in range(2)]
        self.turn = 0
        # On CPU the host buffer is the device buffer.
        self.dev = None if self.device.type == "cpu" else torch.empty(capacity, dtype=self.dtype, device=self.device)

    def upload(self, parts: list[list[int] | np.ndarray]) -> list[torch.Tensor]:
        """Device views of ``parts`` (lists of ints, or numpy arrays, taken flat), in one
        host-to-device copy."""
        sizes = [p.size if isinstance(p, np.ndarray) else len(p) for p in parts]
        total = sum(sizes)
        if total > self.hosts[0].numel():
            self._alloc(max(total, 2 * self.hosts[0].numel()))
        self.turn ^= 1
        host = self.hosts[self.turn]
        start = 0
        for arrays, group in itertools.groupby(zip(parts, sizes), key=lambda ps: isinstance(ps[0], np.ndarray)):
            group = list(group)
            n = sum(size for _, size in group)
            if arrays:
                for a, size in group:
                    host[start : start + size].copy_(torch.from_numpy(np.ascontiguousarray(a).reshape(-1)))
                    start += size
                continue
            flat = list(itertools.chain.from_iterable(p for p, _ in group))
            # torch.tensor then copy_: filling the pinned buffer from a list in place has no fast path.
            host[start : start + n].copy_(torch.tensor(flat, dtype=self.dtype))
            start += n
        if self.dev is None:
            return list(host[:total].split(sizes))
        self.dev[:total].copy_(host[:total], non_blocking=True)
        return list(self.dev[:total].split(sizes))


class InputStaging:
    """The int64, int32 and float32 staging buffers of one runner (or sampler)."""

    def __init__(self, device: torch.device) -> None:
        self.i64 = _Staging(torch.int64, device)
        self.i32 = _Staging(torch.int32, device)
        self.f32 = _Staging(torch.float32, device)
