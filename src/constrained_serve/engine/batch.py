"""What one step computes: the scheduler picks a ``Batch`` of ``ScheduledChunk``s; the
runner (runtime/runner.py) turns it into flat tensors and a
``kernels.attention_metadata.AttentionMetadata``, which every layer's attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: ``num_new`` tokens from ``request.num_computed`` on."""

    request: Request
    num_new: int
    sample: bool  # the chunk reaches the end of the known tokens: its last row samples


@dataclass
class Batch:
    chunks: list[ScheduledChunk]  # decode chunks (num_new == 1) first, then prefill chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.sample]

    def __bool__(self) -> bool:
        return bool(self.chunks)
