"""Where each sequence's tokens, keys and pages are in one step: the type the runner builds
and every attention kernel reads (the model and the kernels import it, not the scheduler's
types)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens, keys and pages are (layout: kernels/attention.py)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU path never syncs on a device tensor.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Split-KV count of the decode rows, fixed by a CUDA graph at capture (cuda_graphs.py);
    # None: chosen per step from the host sizes (decode_split_triton.default_num_splits).
    decode_splits: int | None = None
    # Per-step plans of the torch path (index tensors, masks), built by the first layer.
    plan_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def query_starts_host(self) -> list[int]:
        """Host copy of query_start_loc: sequence b's tokens are q[starts[b]:starts[b+1]]."""
        return [0, *itertools.accumulate(self.query_lens_host)]
