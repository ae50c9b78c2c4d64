"""Turns a step's logits into tokens: per-row parameters -> tensors -> one dispatch call.

Repetition/presence/frequency penalties adjust the logits first (torch, on any device); the
grammar bitmask is applied inside the sampling kernel, before temperature and
top-k/top-p/min-p. Seeds are mixed with the token position, so a seeded request draws the
same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.request import Request
from ..kernels import dispatch
from ..kernels.sampling_tensors import SamplingTensors
from ..kernels.transfer import to_device
from .input_staging import InputStaging

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, position: int) -> int:
    # splitmix64-style mixing: nearby (seed, position) pairs give unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    z ^= z >> 31
    z = (z * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 29)) & _MASK64


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition, presence and frequency penalties (SamplingParams), in place on the rows of
    the requests that set any; one vectorized update over all of them. A token's
    (row, id) pairs are deduplicated with counts, so each is penalized once per row (with
    its output count for frequency_penalty)."""
    rows = [(i, r) for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return
    vocab, dev = logits.shape[1], logits.device

    def unique_pairs(token_lists: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys = torch.tensor([i * vocab + t for i, toks in token_lists for t in toks], dtype=torch.int64)
        keys, counts = keys.unique(return_counts=True)
        keys, counts = to_device(keys, dev), to_device(counts, dev)
        return keys // vocab, keys % vocab, counts

    def per_row(name: str) -> torch.Tensor:  # one value per batch row (rows without penalties: unused)
        return to_device(torch.tensor([getattr(r.params, name) for r in requests], dtype=torch.float32), dev)

    rep = [(i, r.token_ids) for i, r in rows if r.params.repetition_penalty != 1.0]
    if rep:
        row, tok, _ = unique_pairs(rep)
        vals, f = logits[row, tok], per_row("repetition_penalty")[row].to(logits.dtype)
        logits[row, tok] = torch.where(vals > 0, vals / f, vals * f)
    additive = [(i, r.output_ids) for i, r in rows if r.params.presence_penalty or r.params.frequency_penalty]
    if additive and any(toks for _, toks in additive):
        row, tok, counts = unique_pairs(additive)
        pres, freq = per_row("presence_penalty")[row], per_row("frequency_penalty")[row]
        logits[row, tok] -= (pres + freq * counts).to(logits.dtype)


def logprob_entries(lp: torch.Tensor, targets: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row of log-probabilities ``lp``: {its target token: logprob, then the row's k most
    likely tokens: theirs}, k from ``ks``."""
    picked = lp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if max(ks):
        values, ids = lp.topk(max(ks), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        {t: v, **dict(zip(top_ids[j][:k], top_values[j][:k]))} for j, (t, v, k) in enumerate(zip(targets, picked, ks))
    ]


@dataclass
class RawLogprobs:
    """log_softmax of the raw logits of the rows whose request asked for logprobs, kept
    until the step's tokens are known."""

    rows: list[int]  # batch rows that asked
    logprobs: torch.Tensor  # [len(rows), V] fp32
    ks: list[int]  # per asking row, how many most likely tokens it wants (params.logprobs)

    @classmethod
    def of(cls, logits: torch.Tensor, requests: list[Request]) -> "RawLogprobs | None":
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None or r.params.field_confidence]
        if not rows:
            return None
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        return cls(rows, lp, [requests[i].params.logprobs or 0 for i in rows])

    def for_tokens(self, tokens: list[int], num_rows: int) -> list[dict[int, float] | None]:
        """Per batch row: {sampled token: logprob, then the top-k}; None for rows that did not ask."""
        out: list[dict[int, float] | None] = [None] * num_rows
        for i, entry in zip(self.rows, logprob_entries(self.logprobs, [tokens[i] for i in self.rows], self.ks)):
            out[i] = entry
        return out


def record_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int]]) -> None:
    """Score prompt tokens: row j's logits (position p of request r) give the logprob of
    r's prompt token p + 1, then its params.prompt_logprobs most likely tokens, appended to
    r.prompt_logprobs (in position order: the runner sends each position once)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    entries = logprob_entries(lp, [r.token_ids[p + 1] for r, p in rows], [r.params.prompt_logprobs for r, _ in rows])
    for (r, p), entry in zip(rows, entries):
        assert len(r.prompt_logprobs) == p + 1, "prompt logprobs out of order"
        r.prompt_logprobs.append(entry)


@dataclass
class SampledTokens:
    """A step's sampled tokens, possibly still being computed: on CUDA the ids are copied to
    pinned host memory without blocking (one copy per step, the step's only synchronisation
    point); ``result()`` waits for that copy alone."""

    tokens: torch.Tensor  # [rows] int64, on the device: the next step's inputs read them there
    host: torch.Tensor  # the same ids in host memory (once ``ready`` has happened)
    ready: "torch.cuda.Event | None"  # recorded after the copy; None where it was synchronous
    raw: RawLogprobs | None

    def result(self) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """Tokens, and per row the logprobs its request asked for (None when no row asked)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host.tolist()
        return tokens, (self.raw.for_tokens(tokens, len(tokens)) if self.raw is not None else None)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staging = InputStaging(device)
        self._greedy: SamplingTensors | None = None

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: list[Request], bitmask: torch.Tensor | None
    ) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """Tokens, and per row the logprobs its request asked for (None when no row asked)."""
        return self.launch(logits, requests, bitmask).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, requests: list[Request], bitmask: torch.Tensor | None) -> SampledTokens:
        """Sample without waiting for the device: the tokens come with ``result()``."""
        raw = RawLogprobs.of(logits, requests)  # before the penalties change the logits
        tokens = self.draw(logits, requests, bitmask)
        if tokens.device.type != "cuda":
            return SampledTokens(tokens, tokens, None, raw)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return SampledTokens(tokens, host, ready, raw)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request], bitmask: torch.Tensor | None) -> list[int]:
        return self.draw(logits, requests, bitmask).tolist()

    def draw(self, logits: torch.Tensor, requests: list[Request], bitmask: torch.Tensor | None) -> torch.Tensor:
        """The tokens of the rows, on the logits' device (int64)."""
        ps = [r.params for r in requests]
        apply_penalties(logits, requests)
        all_greedy = all(p.temperature == 0.0 for p in ps)
        dev = self.device
        if bitmask is not None:
            bitmask = bitmask.to(dev, non_blocking=True)
        if all_greedy:
            return dispatch.sample(logits, bitmask, self._greedy_params(len(ps)), all_greedy=True)
        # Through pinned staging buffers: a copy from pageable memory would wait for the
        # forward queued before it, and the pipelined loop has work to do meanwhile.
        temps, ks = [p.temperature for p in ps], [p.top_k for p in ps]
        temperature, top_p, min_p = self.staging.f32.upload([temps, [p.top_p for p in ps], [p.min_p for p in ps]])
        (top_k,) = self.staging.i32.upload([ks])
        (seeds,) = self.staging.i64.upload([[step_seed(r.seed, r.num_tokens) for r in requests]])
        # Only the Triton sampler has a candidate path (kernels/sampling_candidates.py, which
        # imports Triton: only where it runs).
        rows: list[int] = []
        if dispatch.use_triton(logits.device):
            from ..kernels.sampling_candidates import candidate_rows

            rows = candidate_rows(temps, ks, logits.shape[-1])
        return dispatch.sample(
            logits,
            bitmask,
            SamplingTensors(temperature, top_k, top_p, min_p, seeds),
            candidates=(rows, max(ps[i].top_k for i in rows)) if rows else None,
        )

    def _greedy_params(self, rows: int) -> SamplingTensors:
        """Parameters for an all-greedy step (the kernels take them; the step's tokens depend
        on none of their values): made once, at the largest batch so far, and sliced, so a
        greedy step allocates nothing for them."""
        if self._greedy is None or self._greedy.seeds.shape[0] < rows:
            self._greedy = SamplingTensors.full(max(rows, 256), self.device)
        return SamplingTensors(*(t[:rows] for t in self._greedy))
