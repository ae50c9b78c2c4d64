"""Which dtype ``Engine()`` runs on CPU when none is asked for: bf16 where it pays, else fp32.

bf16 halves the bytes every decode step reads and, on a CPU with bf16 matrix units (AMX, or
AVX512-BF16's dot products), runs the projections at up to twice fp32's rate: the project's
2-core Xeon (AMX) runs the 64-chat benchmark about 1.8x as fast. Elsewhere bf16 is emulated
(converted to fp32 around each op) and slower. And bf16 rounds: a greedy output may take
another token where two candidates were nearly tied. So fp32 stays the default, and bf16 is
picked only on a CPU that has the units, after a short check on the model itself says both
that it is faster and that its outputs agree with fp32's:

- CPU without the units: fp32 at once, nothing run (``bf16_units`` reads torch's own probe).
- Otherwise, once per (model files, load format, threads, torch version, CPU), the engine
  builds the model in fp32 and then in bf16 (small engines with that dtype: the caller passes
  ``make_decoder``), greedy-decodes the check prompts in each (``compare``) and times a batched
  decode in each; ``decide`` turns that into a ``DtypeChoice``, cached as JSON in the native
  kernels' cache folder, so later starts read it in microseconds.

Agreement is a prefix rule. Both decode ``CHECK_TOKENS`` greedy tokens of every check prompt.
Where the two first differ, the rest cannot be compared (each continues its own text), so the
difference itself is judged: it is a near-tie when fp32 gave bf16's token a logprob within
``TIE_NATS`` of its own pick (its top-``TOP_LOGPROBS`` list holds both), which a bf16 rounding
legitimately flips; anything else (bf16 chose a token fp32 held clearly worse) is a
disagreement. The outputs agree when no prompt disagrees and the tokens compared before the
first differences are at least ``MIN_SHARED`` of all, so a run of early ties does not pass on
no evidence. Identical tokens throughout would be a stricter rule, but a correct bf16 model
breaks it on near-ties, so it would judge rounding rather than correctness: on the default
SmolLM2-135M, 4 of the 6 check prompts first differ between fp32 and bf16, each at a token
fp32 ranked 0.01-0.09 nats below its own pick (133 of 192 tokens matched before them).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..kernels import native_build

logger = logging.getLogger(__name__)

AUTO_ENV = "CONSTRAINED_SERVE_AUTO_BF16"  # "0": never pick bf16 by itself (fp32 on CPU)
CHECK_VERSION = 1  # part of the cache key: bump when the check or the rule changes

# Plain prompts (no chat template), of the kinds the engine writes: prose, code, JSON, numbers.
CHECK_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    '{"name": "Ada Lovelace", "born":',
    "Water boils at a temperature of",
    "1, 2, 3, 5, 8, 13,",
)
CHECK_TOKENS = 32  # greedy tokens per check prompt
TOP_LOGPROBS = 5  # fp32's k most likely tokens at each step, to judge a difference
TIE_NATS = 0.5  # a difference where fp32's logprobs of the two tokens are this close is a near-tie
MIN_SHARED = 0.5  # the share of check tokens that must match before the first differences
# The timed step: a batched greedy decode of short prompts, mostly decode steps; best of a few.
TIMED_ROWS = 16
TIMED_TOKENS = 16
TIMED_RUNS = 2
CHECK_KV_TOKENS = 2048  # the check engines' KV pool: every row of a call at once
MIN_SPEEDUP = 1.2  # bf16 must be this much faster: timing noise is ~5-10%, and rounding has a cost

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Greedy:
    """One check prompt's greedy output: its tokens and, when asked for, per token the
    logprobs of the chosen token and of the most likely ones (``Result.logprobs``)."""

    tokens: list[int]
    top: list[dict[int, float]] = field(default_factory=list)


class GreedyDecoder(Protocol):
    """A model loaded in one dtype: greedy outputs of ``prompts`` (``max_tokens`` each, EOS
    ignored), with the top ``logprobs`` per token when not None. The engine provides it."""

    def __call__(self, prompts: Sequence[str], max_tokens: int, logprobs: int | None) -> list[Greedy]: ...


@dataclass(frozen=True)
class Measurement:
    """One dtype's part of the check: the check prompts' outputs and the timed decode."""

    outputs: list[Greedy]
    seconds: float


@dataclass(frozen=True)
class Agreement:
    agree: bool
    shared: int  # check tokens identical before each prompt's first difference, summed
    total: int
    detail: str  # where and how they differ, "" when they agree


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def bf16_units() -> tuple[str, ...]:
    """This CPU's bf16 matrix units, by name ("AMX", "AVX512-BF16", or "BF16": Arm's BFDOT and
    BFMMLA); empty without any. torch's own probe (``torch.cpu.get_capabilities``: cpuinfo,
    read at run time), or the older torch's ``_is_amx_tile_supported`` and
    ``_is_avx512_bf16_supported`` (x86 only), or the kernel's flags in /proc/cpuinfo. AMX counts
    with both its tiles and its bf16 instructions."""
    if hasattr(torch.cpu, "get_capabilities"):
        caps = dict(torch.cpu.get_capabilities())
    elif hasattr(torch.cpu, "_is_avx512_bf16_supported") and platform.machine() in ("x86_64", "AMD64"):
        amx = torch.cpu._is_amx_tile_supported()  # every CPU with AMX tiles so far has AMX-BF16
        caps = {"amx_tile": amx, "amx_bf16": amx, "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}
    else:
        caps = dict.fromkeys(_cpuinfo_flags(), True)
    found = []
    if caps.get("amx_tile") and caps.get("amx_bf16"):
        found.append("AMX")
    if caps.get("avx512_bf16"):
        found.append("AVX512-BF16")
    if caps.get("bf16"):  # aarch64 (FEAT_BF16)
        found.append("BF16")
    return tuple(found)


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compare(fp32: Sequence[Greedy], bf16: Sequence[Greedy], tie_nats: float = TIE_NATS) -> Agreement:
    """Whether bf16's greedy outputs agree with fp32's, by the prefix rule in the module's
    docstring. ``fp32`` must carry its top logprobs; ``bf16`` only its tokens."""
    shared = total = 0
    for i, (a, b) in enumerate(zip(fp32, bf16)):
        total += len(a.tokens)
        n = min(len(a.tokens), len(b.tokens))
        j = next((k for k in range(n) if a.tokens[k] != b.tokens[k]), n)
        shared += j
        if j == n:
            continue
        top = a.top[j] if j < len(a.top) else {}
        picked, other = top.get(a.tokens[j]), top.get(b.tokens[j])
        if picked is None or other is None or picked - other > tie_nats:
            gap = "not among fp32's most likely" if picked is None or other is None else f"{picked - other:.2f} nats"
            detail = (
                f"check prompt {i}, token {j}: fp32 wrote {a.tokens[j]}, bf16 {b.tokens[j]} "
                f"({gap} below fp32's pick, more than a near-tie's {tie_nats})"
            )
            return Agreement(False, shared, total, detail)
    if total and shared < MIN_SHARED * total:
        detail = f"only {shared} of {total} check tokens matched before near-ties, fewer than {MIN_SHARED:.0%}"
        return Agreement(False, shared, total, detail)
    return Agreement(True, shared, total, "")


def decide(
    fp32: Sequence[Greedy],
    bf16: Sequence[Greedy],
    fp32_s: float,
    bf16_s: float,
    units: str = "bf16 units",
    min_speedup: float = MIN_SPEEDUP,
) -> DtypeChoice:
    """bf16 when its check outputs agree with fp32's (``compare``) and its timed decode is at
    least ``min_speedup`` times as fast; fp32 otherwise, with the reason."""
    agreement = compare(fp32, bf16)
    speedup = fp32_s / bf16_s if bf16_s > 0 else 0.0
    fast = speedup >= min_speedup
    if agreement.agree and fast:
        why = f"{units}; check prompts agree with float32, {speedup:.1f}x as fast"
        return DtypeChoice(torch.bfloat16, why)
    parts = []
    if not agreement.agree:
        parts.append(f"bf16 outputs differ from float32 ({agreement.detail})")
    speed = f"bf16 {speedup:.2f}x as fast as float32 on the timed decode"
    parts.append(speed if fast else f"{speed}, short of the {min_speedup}x that pays for its rounding")
    if agreement.agree:
        parts.append("the check prompts agree")
    return DtypeChoice(torch.float32, f"{units}, but " + "; ".join(parts))


def measure(decode: GreedyDecoder) -> Measurement:
    """One dtype's part of the check: a warm-up (first forwards, kernel builds, weight packs),
    the check prompts' greedy outputs, then the best of ``TIMED_RUNS`` batched decodes."""
    decode(CHECK_PROMPTS[:2], 2, None)
    outputs = decode(CHECK_PROMPTS, CHECK_TOKENS, TOP_LOGPROBS)
    rows = [CHECK_PROMPTS[i % len(CHECK_PROMPTS)] for i in range(TIMED_ROWS)]
    best = math.inf
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        decode(rows, TIMED_TOKENS, None)
        best = min(best, time.perf_counter() - start)
    return Measurement(outputs, best)


def cache_key(model: Path | None, load_format: str, threads: int) -> str:
    """What the verdict holds for: the model's files (path, size, mtime: hashing gigabytes of
    weights would cost more than the check), how they load, the thread count, torch and the
    CPU (``native_build.cpu_identity``: its model and flags)."""
    files: list[list[object]] = []
    if model is not None:
        paths = [model] if model.is_file() else sorted(p for p in model.iterdir() if p.is_file())
        for p in paths:
            st = p.stat()
            files.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    parts = {
        "check": CHECK_VERSION,
        "model": files,
        "load_format": load_format,
        "threads": threads,
        "torch": torch.__version__,
        "cpu": native_build.cpu_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def verdict_folder() -> Path:
    """Where verdicts are kept: next to the native kernels, which are per CPU too."""
    return native_build.cache_dir() / "cpu_dtype"


def read_verdict(key: str) -> DtypeChoice | None:
    path = verdict_folder() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return DtypeChoice(_DTYPE_NAMES[data["dtype"]], str(data["reason"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable: check again
        logger.debug("ignoring the CPU dtype verdict %s: %s", path, e)
        return None


def write_verdict(key: str, choice: DtypeChoice, **details: object) -> None:
    """Written to a temporary name first: a concurrent start reads a whole file or none."""
    path = verdict_folder() / f"{key}.json"
    data = {"dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason, **details}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the CPU dtype verdict in %s (the check reruns next start): %s", path, e)


def choose(
    model: Path | None,
    load_format: str,
    threads: int,
    make_decoder: Callable[[torch.dtype], GreedyDecoder],
    enabled: bool = True,
) -> DtypeChoice:
    """The dtype of an engine on CPU that asked for none (see the module's docstring)."""
    choice, how = _choose(model, load_format, threads, make_decoder, enabled)
    logger.info("CPU dtype: %s (%s)%s", str(choice.dtype).removeprefix("torch."), choice.reason, how)
    return choice


def _choose(
    model: Path | None,
    load_format: str,
    threads: int,
    make_decoder: Callable[[torch.dtype], GreedyDecoder],
    enabled: bool,
) -> tuple[DtypeChoice, str]:
    if not enabled:
        return DtypeChoice(torch.float32, "auto_bf16=False"), ""
    if os.environ.get(AUTO_ENV, "1") == "0":
        return DtypeChoice(torch.float32, f"{AUTO_ENV}=0"), ""
    units = bf16_units()
    if not units:
        return DtypeChoice(torch.float32, "no native bf16 units (AMX or AVX512-BF16) on this CPU"), ""
    key = cache_key(model, load_format, threads)
    cached = read_verdict(key)
    if cached is not None:
        return cached, f"; cached in {verdict_folder() / key}.json"
    logger.info(
        "%s on this CPU: checking bf16 against float32 on %s (once; the verdict is cached in %s)",
        "/".join(units),
        model,
        verdict_folder(),
    )
    start = time.perf_counter()
    try:
        # One model at a time: each check engine is dropped (its cycles collected) before
        # the next loads, so the check needs the memory of the larger one only.
        fp32 = measure(make_decoder(torch.float32))
        gc.collect()
        bf16 = measure(make_decoder(torch.bfloat16))
        gc.collect()
    except Exception as e:  # noqa: BLE001 - any failure of the bf16 build or run means fp32
        logger.warning("the bf16 check failed, float32 it is: %s: %s", type(e).__name__, e)
        choice = DtypeChoice(torch.float32, f"the bf16 check failed ({type(e).__name__}: {e})")
        write_verdict(key, choice)
        return choice, ""
    choice = decide(fp32.outputs, bf16.outputs, fp32.seconds, bf16.seconds, units="/".join(units))
    took = time.perf_counter() - start
    write_verdict(key, choice, fp32_s=fp32.seconds, bf16_s=bf16.seconds, check_s=took, model=str(model))
    return choice, f"; checked in {took:.1f} s"
