"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once at start-up.

A decode step of a small model on a large GPU is bound by kernel launches: every layer
launches a dozen kernels, each costing microseconds of CPU time, so the GPU waits on Python.
A graph replays the whole decoder stack as one launch. As in nano-vllm, SGLang and vLLM:

- Decode steps replay a graph, and so do steps whose chunks are all short (at most
  ``MAX_UNROLLED_CHUNK`` tokens: grammar-forced tokens, the end of a prompt), as long as they
  ask no prompt logprobs. A short chunk is unrolled into one-token rows, each attending to
  its sequence's pages up to its own position (its context length is its position + 1), so
  the decode kernel computes causal attention within the chunk: the K/V of the whole step
  are stored before any row attends, in every layer. A chunk of q tokens reads its context
  q times, which is cheap for short chunks and the price of a fixed shape. Longer prefill
  chunks run eagerly, since their shapes vary with every chunk.
- Graphs exist for bucket sizes 1, 2, 4, 8, then every 16 up to the largest batch; a step of
  n rows replays the smallest bucket >= n, its extra rows padded with harmless work: they
  read and write one scratch KV page that no request owns (the runner allocates it past the
  page pool), at position 0 with a context of one token.
- The graph reads its inputs from static buffers that each step overwrites (ids, positions,
  KV slots, context lengths, block tables) and writes the final hidden states to a static
  output; the LM head runs after it, eagerly, so no bucket holds a [batch, vocab] buffer.
- Everything a kernel's launch depends on is fixed per bucket: the number of decode rows,
  and the split-KV count (``AttentionMetadata.decode_splits``; each split sizes itself from
  the device-side context length, so short contexts just leave splits empty).

Graphs need the Triton attention (the torch path plans from host-side lengths, which a graph
would freeze). ``staged_eager`` runs the same staging without a graph (on CPU too): the tests
check that padded, staged steps give the logits of the plain forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


# The longest chunk a graph step takes, unrolled into one-token rows (see above).
MAX_UNROLLED_CHUNK = 16


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def graph_splits(batch: int, num_kv_heads: int, max_model_len: int, target_programs: int = 256) -> int:
    """Split-KV count a bucket is captured with: enough programs to fill the GPU at this
    batch size, none when the context cannot be long enough to split (256 keys a split)."""
    by_occupancy = -(-target_programs // (batch * num_kv_heads))
    by_length = max(1, max_model_len // 256)
    return int(max(1, min(by_occupancy, by_length, 32)))


def token_context_lens(meta: AttentionMetadata) -> list[int]:
    """Per token of the step, its context length when it is a row of its own (host side)."""
    return [n for q, end in zip(meta.query_lens_host, meta.seq_lens_host) for n in range(end - q + 1, end + 1)]


@dataclass
class StaticInputs:
    """The buffers a graph reads: rows [0, n) are this step's, [n, bucket) padding."""

    input_ids: torch.Tensor  # int64 [M]
    positions: torch.Tensor  # int64 [M]
    slot_mapping: torch.Tensor  # int64 [M]
    seq_lens: torch.Tensor  # int32 [M]
    block_tables: torch.Tensor  # int32 [M, max_pages]
    query_start_loc: torch.Tensor  # int32 [M + 1], 0..M: one token per row, fixed
    rows: torch.Tensor  # int64 [M], 0..M-1: every row runs the last layer; run() picks the sampling rows

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, device: torch.device) -> "StaticInputs":
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch, dtype=torch.int64),
            positions=zeros(max_batch, dtype=torch.int64),
            slot_mapping=zeros(max_batch, dtype=torch.int64),
            seq_lens=zeros(max_batch, dtype=torch.int32),
            block_tables=zeros(max_batch, max_pages, dtype=torch.int32),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            rows=torch.arange(max_batch, dtype=torch.int64, device=device),
        )


class DecodeGraphs:
    """Static buffers, one captured graph per bucket, and the step that replays them."""

    def __init__(
        self,
        model,  # LlamaModel (not imported: the models package stays below this module)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        *,
        max_batch: int,
        max_model_len: int,
        page_size: int,
        scratch_page: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // page_size)
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.num_kv_heads = model.arch.num_kv_heads
        self.static = StaticInputs.allocate(self.max_batch, self.max_pages, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # per bucket: the graph's hidden states
        self.steps = 0  # all-decode steps served here, by a graph or staged eagerly
        self.replays = 0  # of which by a graph (tests and benchmarks read both)
        self.unrolled = 0  # of which had chunks of several tokens
        self._pad_from(0, self.max_batch)

    # ------------------------------------------------------------------ which steps
    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, input_ids: torch.Tensor, meta: AttentionMetadata, prompt_rows: list) -> bool:
        """A step of short chunks (decodes, forced tokens) within the buckets, counted in tokens."""
        n = int(input_ids.shape[0])
        return (
            0 < n <= self.max_batch
            and meta.max_query_len <= MAX_UNROLLED_CHUNK
            and not prompt_rows
            and meta.block_tables.shape[1] <= self.max_pages
        )

    # ------------------------------------------------------------------ staging
    def _pad_from(self, n: int, bucket: int) -> None:
        """Rows [n, bucket) become padding: token 0 at position 0 of the scratch page."""
        if bucket <= n:
            return
        s = self.static
        s.input_ids[n:bucket].zero_()
        s.positions[n:bucket].zero_()
        s.slot_mapping[n:bucket].fill_(self.scratch_page * self.page_size)
        s.seq_lens[n:bucket].fill_(1)
        s.block_tables[n:bucket, 0].fill_(self.scratch_page)

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        n = int(input_ids.shape[0])
        bucket = self.bucket_for(n)
        s = self.static
        s.input_ids[:n].copy_(input_ids, non_blocking=True)
        s.positions[:n].copy_(positions, non_blocking=True)
        s.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        # Columns past this step's width keep older ids: the kernels read a row's pages only
        # up to its context length.
        width = meta.block_tables.shape[1]
        if meta.num_decodes == meta.num_seqs:  # one token a sequence: rows are sequences
            s.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
            s.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        else:  # unrolled: each token a row with its sequence's pages, causal by its position
            s.seq_lens[:n].copy_(positions + 1)
            seq_of_token = torch.repeat_interleave(
                torch.arange(meta.num_seqs, device=positions.device), meta.query_start_loc.diff(), output_size=n
            )
            s.block_tables[:n, :width].copy_(meta.block_tables.index_select(0, seq_of_token))
        self._pad_from(n, bucket)
        return bucket

    def _meta(self, bucket: int, seq_lens_host: list[int]) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            query_start_loc=s.query_start_loc[: bucket + 1],
            seq_lens=s.seq_lens[:bucket],
            block_tables=s.block_tables[:bucket],
            slot_mapping=s.slot_mapping[:bucket],
            num_decodes=bucket,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * bucket,
            seq_lens_host=seq_lens_host,
            decode_splits=graph_splits(bucket, self.num_kv_heads, self.max_model_len),
        )

    def _hidden(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        s = self.static
        return self.model.hidden_states(
            s.input_ids[:bucket], s.positions[:bucket], self.kv_caches, meta, s.rows[:bucket]
        )

    # ------------------------------------------------------------------ running
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the ``logits_indices`` rows of a step that ``fits``: the bucket's graph
        replayed, or, before capture (or on CPU), the same padded step run eagerly."""
        n = int(input_ids.shape[0])
        bucket = self._stage(input_ids, positions, meta)
        self.steps += 1
        self.unrolled += meta.num_decodes != meta.num_seqs
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays += 1
            hidden = self.outputs[bucket]
        else:
            hidden = self._hidden(bucket, self._meta(bucket, token_context_lens(meta) + [1] * (bucket - n)))
        return self.model.logits(hidden.index_select(0, logits_indices))

    def capture(self) -> None:
        """Capture every bucket, largest first, in one shared memory pool. Each bucket runs
        eagerly once first, so Triton compiles its kernels outside the capture."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        pool = None
        with torch.cuda.device(self.device):
            for bucket in reversed(self.buckets):
                self._pad_from(0, bucket)
                meta = self._meta(bucket, [1] * bucket)
                self._hidden(bucket, meta)  # warm-up: kernel compilation, allocator state
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket] = self._hidden(bucket, meta)
                if pool is None:
                    pool = graph.pool()
                self.graphs[bucket] = graph
            torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.buckets)
