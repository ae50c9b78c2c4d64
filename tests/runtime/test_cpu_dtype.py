"""cpu_dtype.py: Engine() on CPU picks bf16 only on a CPU with bf16 units, where a check on the
model finds it faster with outputs agreeing with fp32's. ``decide`` is tested on its
branches; the check itself runs for real on the tiny model, with the CPU-feature probe
monkeypatched to say AMX (this CPU has no bf16 units: bf16 is emulated here)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from constrained_serve import Engine, SamplingParams
from constrained_serve.runtime import cpu_dtype
from constrained_serve.runtime.cpu_dtype import DtypeChoice, Greedy, compare, decide

BF16_FLAGS = {"amx_bf16", "avx512_bf16", "bf16"}


def fp32_run(tokens: list[int], gaps: dict[int, tuple[int, float]] | None = None) -> Greedy:
    """fp32's output with its top logprobs: its token at -0.1, and at the positions in
    ``gaps`` a runner-up token that many nats below (elsewhere token 999, far below)."""
    top = []
    for i, t in enumerate(tokens):
        other, gap = (gaps or {}).get(i, (999, 5.0))
        top.append({t: -0.1, other: -0.1 - gap})
    return Greedy(tokens, top)


@pytest.fixture
def check_env(monkeypatch, tmp_path):
    """Verdicts in a fresh folder, the auto pick on (conftest turns it off for the suite),
    and a count of the dtypes the check measured (the real ``measure`` runs)."""
    monkeypatch.setattr(cpu_dtype, "verdict_folder", lambda: tmp_path)
    monkeypatch.delenv(cpu_dtype.AUTO_ENV, raising=False)
    measured: list[int] = []
    real = cpu_dtype.measure

    def counting(decode):
        measured.append(1)
        return real(decode)

    monkeypatch.setattr(cpu_dtype, "measure", counting)
    return tmp_path, measured


def with_units(monkeypatch, units=("AMX",)):
    monkeypatch.setattr(cpu_dtype, "bf16_units", lambda: units)


def make(tiny_llama_dir, **kw):
    return Engine(model=str(tiny_llama_dir), max_num_seqs=8, kv_cache_tokens=512, **kw)


# ----------------------------------------------------------------------------- the decision


def test_agreeing_and_faster_picks_bf16():
    fp32 = [fp32_run([1, 2, 3, 4]), fp32_run([5, 6, 7, 8])]
    bf16 = [Greedy([1, 2, 3, 4]), Greedy([5, 6, 7, 8])]
    choice = decide(fp32, bf16, fp32_s=1.8, bf16_s=1.0, units="AMX")
    assert choice.dtype is torch.bfloat16
    assert choice.reason == "AMX; check prompts agree with float32, 1.8x as fast"


def test_a_clear_difference_keeps_fp32_and_says_where():
    fp32 = [fp32_run([1, 2, 3, 4]), fp32_run([5, 6, 7, 8], gaps={2: (9, 3.0)})]
    bf16 = [Greedy([1, 2, 3, 4]), Greedy([5, 6, 9, 10])]
    choice = decide(fp32, bf16, fp32_s=2.0, bf16_s=1.0, units="AMX")
    assert choice.dtype is torch.float32
    assert "bf16 outputs differ from float32" in choice.reason
    assert "check prompt 1, token 2: fp32 wrote 7, bf16 9 (3.00 nats below" in choice.reason
    assert "2.00x as fast" in choice.reason and "short of" not in choice.reason


def test_a_token_fp32_did_not_rank_is_a_difference():
    agreement = compare([fp32_run([1, 2, 3, 4])], [Greedy([1, 42, 3, 4])])
    assert not agreement.agree and "not among fp32's most likely" in agreement.detail


def test_a_near_tie_difference_agrees():
    """bf16 took fp32's runner-up where the two were 0.2 nats apart: rounding, not an error."""
    fp32 = [fp32_run([1, 2, 3, 4], gaps={3: (9, 0.2)}), fp32_run([5, 6, 7, 8])]
    bf16 = [Greedy([1, 2, 3, 9]), Greedy([5, 6, 7, 8])]
    agreement = compare(fp32, bf16)
    assert agreement.agree and (agreement.shared, agreement.total) == (7, 8)
    assert decide(fp32, bf16, 1.5, 1.0).dtype is torch.bfloat16


def test_early_near_ties_alone_are_no_evidence():
    fp32 = [fp32_run([1, 2, 3, 4], gaps={0: (9, 0.1)}), fp32_run([5, 6, 7, 8], gaps={1: (9, 0.1)})]
    bf16 = [Greedy([9, 2, 3, 4]), Greedy([5, 9, 7, 8])]
    agreement = compare(fp32, bf16)
    assert not agreement.agree and "only 1 of 8 check tokens matched" in agreement.detail


def test_slower_bf16_keeps_fp32():
    fp32 = [fp32_run([1, 2, 3, 4])]
    choice = decide(fp32, [Greedy([1, 2, 3, 4])], fp32_s=1.1, bf16_s=1.0, units="AVX512-BF16")
    assert choice.dtype is torch.float32
    assert choice.reason == (
        "AVX512-BF16, but bf16 1.10x as fast as float32 on the timed decode, short of the 1.2x "
        "that pays for its rounding; the check prompts agree"
    )


# ----------------------------------------------------------------------------- the probe


def test_the_probe_finds_no_units_where_the_cpu_flags_have_none():
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                flags |= set(line.split(":", 1)[1].split())
    assert not cpu_dtype.bf16_units() or flags & BF16_FLAGS


# ----------------------------------------------------------------------------- Engine()


def test_a_cpu_without_units_runs_fp32_without_a_check(tiny_llama_dir, check_env, monkeypatch, caplog):
    folder, measured = check_env
    with_units(monkeypatch, ())
    with caplog.at_level(logging.INFO, logger="constrained_serve.runtime.cpu_dtype"):
        engine = make(tiny_llama_dir)
    assert engine.dtype is torch.float32
    assert engine.dtype_reason == "no native bf16 units (AMX or AVX512-BF16) on this CPU"
    assert "CPU dtype: float32 (no native bf16 units" in caplog.text
    assert measured == [] and list(folder.iterdir()) == []


@pytest.mark.parametrize(
    ("kw", "env", "dtype", "reason"),
    [
        ({"dtype": "float32"}, None, torch.float32, "dtype='float32' as asked"),
        ({"dtype": "bfloat16"}, None, torch.bfloat16, "dtype='bfloat16' as asked"),
        ({"auto_bf16": False}, None, torch.float32, "auto_bf16=False"),
        ({}, "0", torch.float32, "CONSTRAINED_SERVE_AUTO_BF16=0"),
    ],
)
def test_asked_dtypes_and_the_switches_run_no_check(tiny_llama_dir, check_env, monkeypatch, kw, env, dtype, reason):
    folder, measured = check_env
    with_units(monkeypatch)
    if env is not None:
        monkeypatch.setenv(cpu_dtype.AUTO_ENV, env)
    engine = make(tiny_llama_dir, **kw)
    assert (engine.dtype, engine.dtype_reason) == (dtype, reason)
    assert measured == [] and list(folder.iterdir()) == []


def test_the_check_runs_once_and_its_verdict_is_cached(tiny_llama_dir, check_env, monkeypatch, caplog):
    """Measured for real: bf16 has no hardware here, so it is slower or disagrees (or both);
    the reason says which. A second start reads the verdict and runs nothing."""
    folder, measured = check_env
    with_units(monkeypatch)
    with caplog.at_level(logging.INFO, logger="constrained_serve.runtime.cpu_dtype"):
        first = make(tiny_llama_dir)
    assert measured == [1, 1]  # fp32, then bf16
    assert first.dtype is torch.float32 and first.dtype_reason.startswith("AMX, but ")
    assert "bf16 outputs differ from float32" in first.dtype_reason or "short of the 1.2x" in first.dtype_reason
    assert "checked in" in caplog.text
    [verdict] = folder.iterdir()
    data = json.loads(verdict.read_text())
    assert data["dtype"] == "float32" and data["reason"] == first.dtype_reason
    assert data["fp32_s"] > 0 and data["bf16_s"] > 0
    assert first.generate("Hello", SamplingParams(max_tokens=3))[0].token_ids  # the engine itself runs

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="constrained_serve.runtime.cpu_dtype"):
        second = make(tiny_llama_dir)
    assert measured == [1, 1]
    assert (second.dtype, second.dtype_reason) == (torch.float32, first.dtype_reason)
    assert f"cached in {verdict}" in caplog.text


def test_a_cached_bf16_verdict_is_used_as_it_stands(tiny_llama_dir, check_env, monkeypatch):
    folder, measured = check_env
    with_units(monkeypatch)
    key = cpu_dtype.cache_key(tiny_llama_dir, "auto", 1)
    cpu_dtype.write_verdict(key, DtypeChoice(torch.bfloat16, "AMX; check prompts agree with float32, 1.8x as fast"))
    engine = make(tiny_llama_dir, num_threads=1)
    assert engine.dtype is torch.bfloat16 and engine.model.embed_tokens.weight.dtype is torch.bfloat16
    assert engine.dtype_reason == "AMX; check prompts agree with float32, 1.8x as fast"
    assert measured == []


def test_the_cache_key_follows_the_model(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    key = cpu_dtype.cache_key(tiny_llama_dir, "auto", 2)
    assert cpu_dtype.cache_key(tiny_llama_dir, "auto", 2) == key
    assert cpu_dtype.cache_key(tiny_qwen3_dir, "auto", 2) != key
    assert cpu_dtype.cache_key(tiny_llama_dir, "dummy", 2) != key
    assert cpu_dtype.cache_key(tiny_llama_dir, "auto", 1) != key
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    before = cpu_dtype.cache_key(copy, "auto", 2)
    assert before != key  # another folder
    [weights] = copy.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes() + b" ")  # new weights, same folder
    assert cpu_dtype.cache_key(copy, "auto", 2) != before
