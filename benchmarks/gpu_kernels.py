"""Kernel checks and timings on a GPU: every Triton kernel against its torch reference on
CUDA, then each kernel timed against the obvious torch alternative (medians over repeats).

    python benchmarks/gpu_kernels.py                # on a CUDA machine
    python benchmarks/gpu_kernels.py --cpu-smoke    # tiny sizes, CPU, TRITON_INTERPRET=1

Writes JSON to $OUT/gpu_kernels.json (when $OUT is set) and benchmarks/results/<date>-<gpu>.json.
Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    # Must be set before triton is first imported.
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from constrained_serve.kernels import attention as A  # noqa: E402
from constrained_serve.kernels import sampling as S  # noqa: E402
from constrained_serve.kernels.sampling_tensors import SamplingTensors  # noqa: E402
from tests.kernel.helpers import CHI2_CRIT_001, expected_probs, make_batch  # noqa: E402


class Bench:
    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device = device
        self.repeats = repeats
        self.warmup = warmup
        self.checks: list[dict] = []
        self.timings: list[dict] = []

    def check(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn()
            entry = {"name": name, "ok": True, **(detail or {})}
        except Exception as e:
            entry = {
                "name": name,
                "ok": False,
                "error": f"{type(e).__name__}: {e}"[:3000],
                "traceback": traceback.format_exc()[-3000:],
            }
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        self.checks.append(entry)
        print(("PASS " if entry["ok"] else "FAIL ") + name + ("" if entry["ok"] else "\n" + entry["error"]), flush=True)

    def time_ms(self, fn) -> float:
        """Median milliseconds of fn() over repeats (CUDA events on GPU, wall clock on CPU)."""
        for _ in range(self.warmup):
            fn()
        samples = []
        cuda = self.device.type == "cuda"
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    def compare(self, name: str, shape: dict, impls: dict) -> None:
        entry: dict = {"name": name, **shape}
        for label, fn in impls.items():
            try:
                entry[f"{label}_ms"] = round(self.time_ms(fn), 4)
            except Exception as e:
                entry[f"{label}_error"] = f"{type(e).__name__}: {e}"[:500]
        base = [k for k in entry if k.endswith("_ms") and not k.startswith("triton")]
        for t in [k for k in entry if k.endswith("_ms") and k.startswith("triton")]:
            variant = "" if t == "triton_ms" else t[len("triton_") : -3] + "_"  # e.g. candidates_
            for k in base:
                entry[f"{variant}speedup_vs_{k[:-3]}"] = round(entry[k] / max(entry[t], 1e-9), 3)
        self.timings.append(entry)
        print("TIME " + json.dumps(entry), flush=True)


# ------------------------------------------------------------------------------ attention


def _paged(query_lens, seq_lens, page_size, hkv, group, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-L // page_size) for L in seq_lens) + 4
    meta = make_batch(query_lens, seq_lens, page_size, num_pages, g)
    for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, f, getattr(meta, f).to(device))
    kc = torch.randn(num_pages, page_size, hkv, d, generator=g).to(device=device, dtype=dtype)
    vc = torch.randn(num_pages, page_size, hkv, d, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(sum(query_lens), hkv * group, d, generator=g).to(device=device, dtype=dtype)
    return q, kc, vc, meta


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> dict:
    err = (a.float() - b.float()).abs().max().item()
    if not err <= tol:
        raise AssertionError(f"max abs error {err} > {tol}")
    return {"max_abs_err": err}


_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def attention_checks(b: Bench, smoke: bool) -> None:
    dev = b.device
    if smoke:
        mixed = ([1, 1, 4, 9], [7, 16, 20, 9])
        decode = ([1, 1, 1], [5, 33, 70])
        configs = [(16, 2, 2, 64, torch.float32), (32, 1, 4, 128, torch.bfloat16)]
    else:
        gl = torch.Generator().manual_seed(1)
        nd = 24
        dec_lens = torch.randint(1, 3000, (nd,), generator=gl).tolist()
        pre_q = [512, 100, 257, 33]
        pre_ctx = [0, 1000, 64, 4095]
        mixed = ([1] * nd + pre_q, dec_lens + [c + n for c, n in zip(pre_ctx, pre_q)])
        decode = ([1] * 16, torch.randint(1, 20000, (16,), generator=gl).tolist())
        configs = [
            (ps, hkv, grp, d, dt)
            for ps in (16, 128)
            for (hkv, grp) in ((8, 4), (4, 1))
            for d in (64, 128)
            for dt in (torch.bfloat16, torch.float16)
        ] + [(16, 8, 4, 128, torch.float32)]
    for ps, hkv, grp, d, dt in configs:
        tag = f"ps{ps}_hkv{hkv}_g{grp}_d{d}_{str(dt)[6:]}"

        def run_mixed(ps=ps, hkv=hkv, grp=grp, d=d, dt=dt):
            q, kc, vc, meta = _paged(*mixed, ps, hkv, grp, d, dt, dev)
            ref = A.paged_attention_torch(q, kc, vc, meta, d**-0.5)
            out = A.paged_attention_triton(q, kc, vc, meta, d**-0.5, num_splits=1)
            return _close(out, ref, _TOL[dt])

        def run_split(ps=ps, hkv=hkv, grp=grp, d=d, dt=dt):
            q, kc, vc, meta = _paged(*decode, ps, hkv, grp, d, dt, dev, seed=1)
            ref = A.paged_attention_torch(q, kc, vc, meta, d**-0.5)
            res = {}
            for ns in (None, 3, 8):
                out = A.paged_attention_triton(q, kc, vc, meta, d**-0.5, num_splits=ns)
                res[f"splits_{ns}"] = _close(out, ref, _TOL[dt])["max_abs_err"]
            return res

        b.check(f"attention_mixed_{tag}", run_mixed)
        b.check(f"attention_decode_split_{tag}", run_split)

    def run_store():
        g = torch.Generator().manual_seed(2)
        T, hkv, d, pages, ps = (10, 2, 64, 6, 16) if smoke else (4096, 8, 128, 512, 16)
        k = torch.randn(T, hkv, d, generator=g).to(dev, torch.bfloat16)
        v = torch.randn(T, hkv, d, generator=g).to(dev, torch.bfloat16)
        slots = torch.randperm(pages * ps, generator=g)[:T].to(dev)
        kr = torch.zeros(pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
        vr, kt, vt = kr.clone(), kr.clone(), kr.clone()
        A.store_kv_torch(k, v, kr, vr, slots)
        A.store_kv_triton(k, v, kt, vt, slots)
        assert torch.equal(kr, kt) and torch.equal(vr, vt)

    b.check("store_kv_bf16", run_store)


def attention_timings(b: Bench, smoke: bool) -> None:
    dev = b.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hkv, grp, d, ps = (2, 2, 64, 16) if smoke else (8, 4, 128, 16)
    scale = d**-0.5
    decode_cases = [(4, 64)] if smoke else [(64, 2048), (256, 1024), (8, 16384), (1, 32768)]
    for B, L in decode_cases:
        q, kc, vc, meta = _paged([1] * B, [L] * B, ps, hkv, grp, d, dt, dev)
        pages = meta.block_tables[:, : -(-L // ps)].long()
        kd = kc[pages].reshape(B, -1, hkv, d)[:, :L].transpose(1, 2).contiguous()
        vd = vc[pages].reshape(B, -1, hkv, d)[:, :L].transpose(1, 2).contiguous()
        qd = q.view(B, hkv * grp, 1, d)
        splits = A.default_num_splits(meta, hkv)
        b.compare(
            "attention_decode",
            {"batch": B, "ctx": L, "hq": hkv * grp, "hkv": hkv, "d": d, "page_size": ps, "num_splits": splits},
            {
                "triton": lambda: A.paged_attention_triton(q, kc, vc, meta, scale),
                "triton_nosplit": lambda: A.paged_attention_triton(q, kc, vc, meta, scale, num_splits=1),
                "sdpa_contiguous": lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True),
                "torch_reference": lambda: A.paged_attention_torch(q, kc, vc, meta, scale),
            },
        )
    prefill_cases = [(2, 16)] if smoke else [(4, 2048), (1, 8192)]
    for B, n in prefill_cases:
        q, kc, vc, meta = _paged([n] * B, [n] * B, ps, hkv, grp, d, dt, dev)
        pages = meta.block_tables[:, : -(-n // ps)].long()
        kd = kc[pages].reshape(B, -1, hkv, d)[:, :n].transpose(1, 2).contiguous()
        vd = vc[pages].reshape(B, -1, hkv, d)[:, :n].transpose(1, 2).contiguous()
        qd = q.view(B, n, hkv * grp, d).transpose(1, 2).contiguous()
        b.compare(
            "attention_prefill",
            {"batch": B, "chunk": n, "hq": hkv * grp, "hkv": hkv, "d": d},
            {
                "triton": lambda: A.paged_attention_triton(q, kc, vc, meta, scale),
                "sdpa_contiguous": lambda: F.scaled_dot_product_attention(
                    qd, kd, vd, scale=scale, is_causal=True, enable_gqa=True
                ),
                "torch_reference": lambda: A.paged_attention_torch(q, kc, vc, meta, scale),
            },
        )
    nd, npf = (2, 1) if smoke else (64, 2)
    ctx, chunk = (40, 8) if smoke else (2048, 512)
    q, kc, vc, meta = _paged([1] * nd + [chunk] * npf, [ctx] * nd + [chunk + ctx] * npf, ps, hkv, grp, d, dt, dev)
    b.compare(
        "attention_mixed",
        {"decodes": nd, "ctx": ctx, "prefills": npf, "chunk": chunk},
        {
            "triton": lambda: A.paged_attention_triton(q, kc, vc, meta, scale),
            "torch_reference": lambda: A.paged_attention_torch(q, kc, vc, meta, scale),
        },
    )
    T = 16 if smoke else 8192
    k = torch.randn(T, hkv, d, device=dev, dtype=dt)
    v = torch.randn(T, hkv, d, device=dev, dtype=dt)
    kc = torch.zeros(-(-T // ps) + 8, ps, hkv, d, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * ps, device=dev)[:T]
    b.compare(
        "store_kv",
        {"tokens": T, "hkv": hkv, "d": d},
        {
            "triton": lambda: A.store_kv_triton(k, v, kc, vc, slots),
            "torch_reference": lambda: A.store_kv_torch(k, v, kc, vc, slots),
        },
    )


def attention_sweep(b: Bench, smoke: bool) -> None:
    """Launch settings of the Triton attention against SDPA, to choose the defaults for this
    GPU: prefill (rows per program, keys per tile, warps, pipeline stages) and decode (splits,
    warps). Each setting is one more ``attention_*_sweep`` row; the best is printed."""
    import itertools

    dev = b.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hkv, grp, d, ps = (2, 2, 64, 16) if smoke else (8, 4, 128, 16)
    scale = d**-0.5
    B, n = (1, 32) if smoke else (4, 2048)
    q, kc, vc, meta = _paged([n] * B, [n] * B, ps, hkv, grp, d, dt, dev)
    pages = meta.block_tables[:, : -(-n // ps)].long()
    kd = kc[pages].reshape(B, -1, hkv, d)[:, :n].transpose(1, 2).contiguous()
    vd = vc[pages].reshape(B, -1, hkv, d)[:, :n].transpose(1, 2).contiguous()
    qd = q.view(B, n, hkv * grp, d).transpose(1, 2).contiguous()
    sdpa = b.time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, is_causal=True, enable_gqa=True))
    grid = [(16,), (16,), (4,), (1,)] if smoke else [(64, 128), (64, 128), (4, 8), (2, 3)]
    rows = []
    for bm, bn, warps, stages in itertools.product(*grid):
        opts = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            ms = b.time_ms(lambda: A.paged_attention_triton(q, kc, vc, meta, scale, **opts))
        except Exception as e:  # noqa: BLE001 - a setting that does not fit this GPU (shared memory)
            rows.append({"name": "attention_prefill_sweep", **opts, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({"name": "attention_prefill_sweep", "batch": B, "chunk": n, **opts, "triton_ms": round(ms, 4)})
        rows[-1]["speedup_vs_sdpa_contiguous"] = round(sdpa / ms, 3)
    B, L = (4, 64) if smoke else (256, 1024)
    q, kc, vc, meta = _paged([1] * B, [L] * B, ps, hkv, grp, d, dt, dev)
    pages = meta.block_tables[:, : -(-L // ps)].long()
    kd = kc[pages].reshape(B, -1, hkv, d)[:, :L].transpose(1, 2).contiguous()
    vd = vc[pages].reshape(B, -1, hkv, d)[:, :L].transpose(1, 2).contiguous()
    qd = q.view(B, hkv * grp, 1, d)
    sdpa = b.time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
    for splits, warps in itertools.product(*([(1, 2), (4,)] if smoke else [(1, 2, 4, 8), (4, 8)])):
        opts = dict(num_splits=splits, num_warps=warps)
        ms = b.time_ms(lambda: A.paged_attention_triton(q, kc, vc, meta, scale, **opts))
        rows.append({"name": "attention_decode_sweep", "batch": B, "ctx": L, **opts, "triton_ms": round(ms, 4)})
        rows[-1]["speedup_vs_sdpa_contiguous"] = round(sdpa / ms, 3)
    b.timings.extend(rows)
    for name in ("attention_prefill_sweep", "attention_decode_sweep"):
        timed = [r for r in rows if r["name"] == name and "triton_ms" in r]
        best = min(timed, key=lambda r: r["triton_ms"])
        print("BEST " + json.dumps(best), flush=True)


# ------------------------------------------------------------------------------- sampling


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    R, V = allowed.shape
    W = -(-V // 32)
    padded = torch.zeros(R, W * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :V] = allowed.long()
    words = (padded.view(R, W, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def sampling_checks(b: Bench, smoke: bool) -> None:
    dev = b.device
    R, V = (64, 100) if smoke else (4096, 32000)

    def bitmask_equal():
        g = torch.Generator().manual_seed(0)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            logits = torch.randn(R, V, generator=g).to(dev, dt)
            allowed = (torch.rand(R, V, generator=g) < 0.3).to(dev)
            allowed[0] = True
            bm = _pack(allowed)
            assert torch.equal(S.apply_bitmask_torch(logits.clone(), bm), S.apply_bitmask_triton(logits.clone(), bm)), (
                dt
            )

    def masked_never_and_greedy():
        g = torch.Generator().manual_seed(1)
        allowed = torch.rand(R, V, generator=g) < 0.2
        allowed[torch.arange(R), torch.randint(0, V, (R,), generator=g)] = True
        logits = (torch.randn(R, V, generator=g) + 8.0 * (~allowed).float()).to(dev, torch.bfloat16)
        allowed = allowed.to(dev)
        bm = _pack(allowed)
        temperature = torch.rand(R, generator=g) * 2.0
        temperature[::5] = 0.0
        params = SamplingTensors.full(
            R,
            dev,
            temperature,
            torch.randint(0, 50, (R,), generator=g),
            torch.where(torch.rand(R, generator=g) < 0.5, 0.9, 1.0),
            torch.where(torch.rand(R, generator=g) < 0.3, 0.05, 0.0),
        )
        tok = S.sample_triton(logits, bm, params)
        assert bool(allowed[torch.arange(R, device=dev), tok].all()), "drew a masked token"
        want = logits.float().masked_fill(~allowed, -math.inf).argmax(-1)
        greedy = S.sample_triton(logits, bm, params, all_greedy=True)
        assert torch.equal(greedy, want), "all_greedy != masked argmax"
        zero = params.temperature == 0
        assert torch.equal(tok[zero], want[zero]), "temperature 0 rows != masked argmax"
        assert torch.equal(tok, S.sample_triton(logits, bm, params)), "same seeds, other tokens"

    def chi_square():
        N = 3000 if smoke else 200_000
        base = torch.linspace(-1.5, 1.5, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(0))]
        out = {}
        for name, T, k, p, mp in (
            ("plain", 1.0, 0, 1.0, 0.0),
            ("topk", 0.7, 5, 1.0, 0.0),
            ("topp", 1.0, 0, 0.8, 0.0),
            ("all", 1.5, 6, 0.9, 0.05),
        ):
            tok = S.sample_triton(base.repeat(N, 1).to(dev), None, SamplingTensors.full(N, dev, T, k, p, mp))
            counts = torch.bincount(tok, minlength=12).double().cpu()
            exp = expected_probs(base, None, T, k, p, mp) * N
            kept = exp > 0
            assert counts[~kept].sum() == 0, (name, counts.tolist())
            stat = float(((counts[kept] - exp[kept]) ** 2 / exp[kept]).sum())
            df = int(kept.sum()) - 1
            assert stat < CHI2_CRIT_001[df], (name, stat, df)
            out[name] = round(stat, 2)
        return {"chi2": out}

    b.check("sampling_bitmask_equal", bitmask_equal)
    b.check("sampling_masked_never_greedy_seeded", masked_never_and_greedy)
    b.check("sampling_chi_square", chi_square)


def sampling_timings(b: Bench, smoke: bool) -> None:
    dev = b.device
    R, V = (8, 300) if smoke else (256, 128256)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(R, V, generator=g).to(dev, dt)
    allowed = (torch.rand(R, V, generator=g) < 0.5).to(dev)
    bm = _pack(allowed)
    plain = SamplingTensors.full(R, dev, 1.0)
    filt = SamplingTensors.full(R, dev, 0.8, 50, 0.9, 0.0)

    def torch_alternative():
        x = logits.float().masked_fill(~S.unpack_bitmask(bm, V), float("-inf"))
        return torch.multinomial(torch.softmax(x / 0.8, dim=-1), 1)

    def torch_alternative_topk_topp():
        x = logits.float().masked_fill(~S.unpack_bitmask(bm, V), float("-inf")) / 0.8
        vals, idx = x.topk(50, dim=-1)
        probs = torch.softmax(vals, dim=-1)
        sp, order = probs.sort(dim=-1, descending=True)
        sp = sp.masked_fill((sp.cumsum(-1) - sp) >= 0.9, 0.0)
        pick = torch.multinomial(sp, 1)
        return idx.gather(1, order.gather(1, pick))

    shape = {"rows": R, "vocab": V}
    b.compare(
        "sample_plain",
        shape,
        {
            "triton": lambda: S.sample_triton(logits, bm, plain),
            "torch_masked_softmax_multinomial": torch_alternative,
        },
    )
    b.compare(
        "sample_topk50_topp0.9",
        shape,
        {
            "triton": lambda: S.sample_triton(logits, bm, filt),
            # what the engine runs for rows with 0 < top_k <= 1024 (sampling_candidates.py)
            "triton_candidates": lambda: S.sample_triton(logits, bm, filt, candidates=(list(range(R)), 50)),
            "torch_masked_topk_topp_multinomial": torch_alternative_topk_topp,
            "torch_reference": lambda: S.sample_torch(logits, bm, filt),
        },
    )
    b.compare(
        "sample_greedy",
        shape,
        {
            "triton": lambda: S.sample_triton(logits, bm, plain, all_greedy=True),
            "torch_masked_argmax": lambda: logits.masked_fill(~S.unpack_bitmask(bm, V), float("-inf")).argmax(-1),
        },
    )
    work = logits.clone()
    b.compare(
        "apply_bitmask",
        shape,
        {
            "triton": lambda: S.apply_bitmask_triton(work, bm),
            "torch_reference": lambda: S.apply_bitmask_torch(work, bm),
        },
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Triton kernel checks and timings")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1 (checks the script itself)"
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-timings", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the attention's launch settings (attention_sweep)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep alone: no checks, no other timings")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-smoke", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if smoke else "cuda")
    b = Bench(
        dev, args.repeats or (2 if smoke else 30), args.warmup if args.warmup is not None else (1 if smoke else 5)
    )
    torch.manual_seed(0)
    if not args.sweep_only:
        attention_checks(b, smoke)
        sampling_checks(b, smoke)
        if not args.no_timings:
            attention_timings(b, smoke)
            sampling_timings(b, smoke)
    if args.sweep or args.sweep_only:
        attention_sweep(b, smoke)
    gpu = "cpu-interpreter" if smoke else torch.cuda.get_device_name(0)
    import triton

    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "smoke": smoke,
        "checks_passed": sum(c["ok"] for c in b.checks),
        "checks_failed": sum(not c["ok"] for c in b.checks),
        "checks": b.checks,
        "timings": b.timings,
    }
    text = json.dumps(report, indent=1)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower()
    name = f"{_dt.date.today().isoformat()}-{slug}{'-sweep' if args.sweep_only else ''}.json"
    if not smoke:
        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.results_dir) / name).write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        stem = "gpu_kernels" + ("_sweep" if args.sweep_only else "") + ("_smoke" if smoke else "")
        (Path(os.environ["OUT"]) / f"{stem}.json").write_text(text)
    print(f"checks: {report['checks_passed']} passed, {report['checks_failed']} failed", flush=True)
    return 1 if report["checks_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
