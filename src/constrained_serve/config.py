"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class EngineConfig:
    model: str | os.PathLike | None = None  # None: the default SmolLM2-135M-Instruct
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str | torch.dtype | None = None  # None: bf16 on CUDA; on CPU fp32, or bf16 (auto_bf16)
    # On a CPU with bf16 matrix units (AMX, AVX512-BF16) and dtype None, pick bf16 where a
    # short check on the model finds it faster with outputs agreeing with fp32's, once per
    # model and CPU (runtime/cpu_dtype.py); False (or CONSTRAINED_SERVE_AUTO_BF16=0): fp32.
    auto_bf16: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: 512 on CPU, 8192 on CUDA
    kv_cache_tokens: int | None = None  # None: from kv_cache_memory_fraction (CUDA) or 32768 (CPU)
    kv_cache_memory_fraction: float = 0.85  # share of free GPU memory for the KV pool
    page_size: int = 16
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    grammar_backend: str = "llguidance"
    overlap: bool = True  # fill grammar masks while the forward runs
    fast_forward: bool = True  # append grammar-forced tokens without a decode step each
    # Schedule and launch step N+1 before reading step N's tokens, so host work overlaps the
    # GPU (engine.py). None: on CUDA only (on CPU the forward is synchronous: nothing to gain).
    pipeline: bool | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU; None: $OMP_NUM_THREADS, else all cores
    # On CPU, run the forward on fewer threads while that is faster, e.g. when other processes
    # take cores (thread_tuner.py); num_threads is the most it uses. False: always num_threads.
    adaptive_threads: bool = True
    load_format: str = "auto"  # "auto" | "dummy" (random weights in the model's shapes)
    seed: int = 0  # draws the seeds of requests that give none
    conversation_lock_fraction: float = 0.5  # share of the pool open conversations may pin
    # Grammar work runs in worker processes that are killed when it overruns these deadlines
    # (SamplingParams can set them per request); "inline" runs it in this process, unbounded.
    grammar_compile_timeout_s: float = 10.0
    grammar_mask_timeout_s: float | None = None  # None: 0.5 s with llguidance, 3 s with xgrammar
    grammar_isolation: str = "process"  # "process" | "inline"
    # Mask worker processes per backend, rows split over them: None is 1 on CPU (the forward
    # has the cores) and min(8, cores / 2) on CUDA (the forward runs on the GPU).
    grammar_mask_workers: int | None = None
    # CUDA: replay steps of decodes and short chunks through CUDA graphs captured at start-up
    # (cuda_graphs.py), for steps up to cuda_graph_max_batch tokens (None: max_num_seqs and a
    # quarter more, at most 512). False is vLLM's enforce_eager.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if isinstance(self.dtype, str) and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must be >= page_size ({self.page_size}), got {self.kv_cache_tokens}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1) or self.page_size > 128:
            raise ValueError(f"page_size must be a power of two <= 128, got {self.page_size}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.grammar_backend not in ("llguidance", "xgrammar"):
            raise ValueError(f"grammar_backend must be 'llguidance' or 'xgrammar', got {self.grammar_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and an output token), got {self.max_model_len}"
            )
        for name in ("grammar_compile_timeout_s", "grammar_mask_timeout_s"):
            if getattr(self, name) is None and name == "grammar_mask_timeout_s":
                continue
            if not (isinstance(getattr(self, name), (int, float)) and 0 < getattr(self, name) <= 3600):
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {getattr(self, name)!r}")
        if self.grammar_mask_workers is not None and not (
            type(self.grammar_mask_workers) is int and 1 <= self.grammar_mask_workers <= 64
        ):
            raise ValueError(f"grammar_mask_workers must be an int in [1, 64], got {self.grammar_mask_workers!r}")
        if self.cuda_graph_max_batch is not None and not (
            type(self.cuda_graph_max_batch) is int and 1 <= self.cuda_graph_max_batch <= 1024
        ):
            raise ValueError(f"cuda_graph_max_batch must be an int in [1, 1024], got {self.cuda_graph_max_batch!r}")
        if self.grammar_isolation not in ("process", "inline"):
            raise ValueError(f"grammar_isolation must be 'process' or 'inline', got {self.grammar_isolation!r}")
        if not 0 <= self.conversation_lock_fraction <= 1:
            raise ValueError(f"conversation_lock_fraction must be in [0, 1], got {self.conversation_lock_fraction}")

    def cpu_threads(self) -> int:
        """Intra-op threads on CPU: num_threads, else a positive OMP_NUM_THREADS, else all cores."""
        if self.num_threads is not None:
            return self.num_threads
        env = os.environ.get("OMP_NUM_THREADS", "")
        return int(env) if env.isdigit() and int(env) > 0 else (os.cpu_count() or 1)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype asked for, else the device's default (bf16 on CUDA, fp32 on CPU: the
        engine may pick bf16 over that on CPU, see ``auto_bf16``)."""
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return self.dtype if isinstance(self.dtype, torch.dtype) else _DTYPES[self.dtype]

    def graph_batch(self) -> int:
        """The largest step, in tokens, a CUDA graph is captured for: a decode row for each
        sequence and a quarter more for short chunks of forced tokens (cuda_graphs.py)."""
        most = self.max_num_seqs + max(8, self.max_num_seqs // 4)
        if self.cuda_graph_max_batch is not None:
            return min(self.cuda_graph_max_batch, most)
        return min(most, 512)

    def batched_tokens(self, device: torch.device) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 512
