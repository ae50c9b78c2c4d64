"""Batch -> tensors -> forward -> logits.

The runner owns the model and the KV page tensors. ``prepare`` turns a scheduled batch into
flat input tensors (host work, done before the forward is launched); ``forward`` runs the
model and returns logits for the rows that sample only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..engine.batch import Batch
from ..engine.request import Request
from ..kernels import attention
from ..kernels.attention_metadata import AttentionMetadata
from ..kernels.dispatch import use_triton
from ..kernels.kv_layout import allocate_pool
from ..models.llama import LlamaModel
from .block_tables import BlockTables
from .cuda_graphs import DecodeGraphs
from .input_staging import InputStaging
from .thread_tuner import ThreadTuner


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the sampling rows, then the prompt-logprob rows
    # Prompt-logprob rows (after the sampling rows in the logits): (request, position p)
    # whose logits score prompt token p + 1.
    prompt_rows: list[tuple[Request, int]]


logger = logging.getLogger(__name__)


def graphs_supported(model: LlamaModel, k_cache: torch.Tensor, device: torch.device) -> bool:
    """Graphs replay the Triton attention only: the torch path plans from host-side lengths."""
    if device.type != "cuda" or not use_triton(device):
        return False
    a = model.arch
    q = torch.empty(1, a.num_heads, a.head_dim, dtype=k_cache.dtype, device=device)
    return attention.triton_supports(q, k_cache)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, num_pages: int, page_size: int, device: torch.device, kv_dtype: torch.dtype
    ) -> None:
        self.model = model
        self.device = device
        self.page_size = page_size
        self.num_pages = num_pages
        a = model.arch
        # Head-major storage where the torch attention runs (its gathers then feed batched
        # GEMMs directly); the Triton kernels' page-major layout elsewhere. See kv_layout.py.
        head_major = not use_triton(device)

        # One page past the pool that no request is given: the padding rows of a CUDA graph
        # bucket write their K/V there (cuda_graphs.py).
        self.scratch_page = num_pages

        def pool() -> torch.Tensor:
            return allocate_pool(num_pages + 1, page_size, a.num_kv_heads, a.head_dim, kv_dtype, device, head_major)

        self.kv_caches = [(pool(), pool()) for _ in range(a.num_layers)]
        self.tokens_computed = 0  # total tokens run through the model (tests assert on it)
        self.graphs: DecodeGraphs | None = None
        self.staging = InputStaging(device)
        self.block_tables = BlockTables()
        self.thread_tuner: ThreadTuner | None = None  # CPU: adapts the forward's threads (thread_tuner.py)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, *, capture: bool = True) -> bool:
        """Serve all-decode steps of up to ``max_batch`` rows through CUDA graphs (captured
        now). ``capture=False`` stages the same padded steps but runs them eagerly (CPU tests).
        A capture that fails leaves decoding eager, with a warning; returns whether graphs run."""
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.device,
            max_batch=max_batch,
            max_model_len=max_model_len,
            page_size=self.page_size,
            scratch_page=self.scratch_page,
        )
        if capture:
            if not graphs_supported(self.model, self.kv_caches[0][0], self.device):
                logger.info("CUDA graphs need the Triton attention kernels for this model: decode runs eagerly")
                return False
            try:
                graphs.capture()
            except Exception as e:  # noqa: BLE001 - an engine that decodes eagerly beats none
                logger.warning("CUDA graph capture failed, decode runs eagerly: %s: %s", type(e).__name__, e)
                return False
        self.graphs = graphs
        return True

    def copy_page_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the K/V of the first n slots of page src into page dst, in every layer."""
        for k, v in self.kv_caches:
            k[dst, :n] = k[src, :n]
            v[dst, :n] = v[src, :n]

    @staticmethod
    def kv_bytes_per_token(model: LlamaModel, kv_dtype: torch.dtype) -> int:
        a = model.arch
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * torch.empty((), dtype=kv_dtype).element_size()

    def prepare(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> ForwardInputs:
        """The step's input tensors. ``pending_tokens``: the launched step's sampled ids, on
        the device, for the placeholders of requests whose token is not read yet (engine.py's
        pipelined loop): they are copied into the inputs there, without the host seeing them."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        prompt_idx: list[int] = []
        prompt_rows: list[tuple[Request, int]] = []
        pending_at: list[int] = []  # input rows holding a placeholder
        pending_from: list[int] = []  # their rows in pending_tokens
        max_pages = 1
        num_decodes = 0
        for c in batch.chunks:
            r = c.request
            start, end = r.num_computed, r.num_computed + c.num_new
            if r.pending_row is not None:  # the placeholder ends token_ids, so this chunk
                pending_at.append(len(input_ids) + r.num_tokens - 1 - start)
                pending_from.append(r.pending_row)
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            pages = r.pages
            slots.extend(pages[p // ps] * ps + p % ps for p in range(start, end))
            q_lens.append(c.num_new)
            seq_lens.append(end)
            if c.num_new == 1 and num_decodes == len(q_lens) - 1:
                num_decodes += 1
            if c.sample:
                logits_idx.append(len(input_ids) - 1)
            if r.prompt_logprobs is not None:
                # Positions whose next token is a prompt token not scored yet (a recompute
                # after preemption scores nothing twice).
                first = len(input_ids) - c.num_new
                for p in range(max(start, len(r.prompt_logprobs) - 1), min(end, r.num_prompt - 1)):
                    prompt_idx.append(first + p - start)
                    prompt_rows.append((r, p))
            max_pages = max(max_pages, -(-end // ps))
        # Block tables: the rows kept across steps, updated where pages changed (block_tables.py).
        table = self.block_tables.gather([c.request for c in batch.chunks], [-(-n // ps) for n in seq_lens], max_pages)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        ids_t, pos_t, slots_t, rows_t, at_t, from_t = self.staging.i64.upload(
            [input_ids, positions, slots, logits_idx + prompt_idx, pending_at, pending_from]
        )
        if pending_at:
            if pending_tokens is None:
                raise RuntimeError("a request waits for a sampled token, but no launched step was given")
            ids_t[at_t] = pending_tokens[from_t].to(ids_t.dtype)
        qsl_t, lens_t, table_t = self.staging.i32.upload([qsl, seq_lens, table])
        meta = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            block_tables=table_t.view(len(seq_lens), max_pages),
            slot_mapping=slots_t,
            num_decodes=num_decodes,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=q_lens,
            seq_lens_host=seq_lens,
        )
        return ForwardInputs(
            input_ids=ids_t, positions=pos_t, meta=meta, logits_indices=rows_t, prompt_rows=prompt_rows
        )

    def release(self, r: Request) -> None:
        """Forget what the runner keeps of a request that finished (its block-table row)."""
        self.block_tables.release(r.request_id)

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """Logits [num_sampling_rows, vocab] (fp32). On CUDA this returns before the GPU is done."""
        self.tokens_computed += int(inputs.input_ids.shape[0])
        if self.graphs is not None and self.graphs.fits(inputs.input_ids, inputs.meta, inputs.prompt_rows):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        t = time.perf_counter()
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_indices)
        if self.thread_tuner is not None:  # CPU only, where the forward is synchronous
            self.thread_tuner.observe(int(inputs.input_ids.shape[0]), time.perf_counter() - t)
        return out
