"""Compile every Triton kernel for a GPU target without a GPU (no driver needed).

The interpreter runs kernels as Python, so code that only the real compiler rejects
(a reassigned constexpr, a type that changes across a loop, a bad dot shape) passes the CPU
tests. This lowers each kernel, for the signatures the wrappers use, either through the
frontend only (--frontend-only: fast, catches those errors) or all the way to a cubin with
the ptxas bundled in the triton wheel. Must run with TRITON_INTERPRET unset or 0.

    python benchmarks/compile_check.py [--arch 90] [--frontend-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("compile_check.py needs TRITON_INTERPRET unset (the interpreter has no compiler)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from constrained_serve.kernels import attention_triton as A  # noqa: E402
from constrained_serve.kernels import decode_split_triton as D  # noqa: E402
from constrained_serve.kernels import sampling_triton as S  # noqa: E402


def _i32(*names: str) -> dict[str, str]:
    return {n: "i32" for n in names}


def _cx(*names: str) -> dict[str, str]:
    return {n: "constexpr" for n in names}


def cases() -> list[tuple[str, object, dict, dict]]:
    out = []
    out.append(
        (
            "store_kv",
            A._store_kv_kernel,
            {
                "k_ptr": "*bf16",
                "v_ptr": "*bf16",
                "k_cache_ptr": "*bf16",
                "v_cache_ptr": "*bf16",
                "slot_ptr": "*i64",
                **_i32(
                    "stride_kt",
                    "stride_kh",
                    "stride_vt",
                    "stride_vh",
                    "stride_ks",
                    "stride_kch",
                    "stride_vs",
                    "stride_vch",
                ),
                **_cx("NUM_KV_HEADS", "HEAD_DIM", "BLOCK_H"),
            },
            {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8},
        )
    )
    for dt, fp32 in (("bf16", False), ("fp16", False), ("fp32", True)):
        p = "*" + dt
        out.append(
            (
                f"paged_attn_{dt}",
                A._paged_attn_kernel,
                {
                    "q_ptr": p,
                    "k_cache_ptr": p,
                    "v_cache_ptr": p,
                    "out_ptr": p,
                    "qsl_ptr": "*i32",
                    "seq_lens_ptr": "*i32",
                    "bt_ptr": "*i32",
                    "scale_log2": "fp32",
                    "seq_offset": "i32",
                    **_i32(
                        *"stride_qt stride_qh stride_ot stride_oh stride_bt stride_kp stride_ks "
                        "stride_kh stride_vp stride_vs stride_vh".split()
                    ),
                    **_cx("GROUP", "HEAD_DIM", "PAGE_SIZE", "BLOCK_M", "BLOCK_N", "DOT_FP32"),
                },
                {"GROUP": 4, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "DOT_FP32": fp32},
            )
        )
        out.append(
            (
                f"decode_split_{dt}",
                D._paged_decode_split_kernel,
                {
                    "q_ptr": p,
                    "k_cache_ptr": p,
                    "v_cache_ptr": p,
                    "part_out_ptr": "*fp32",
                    "part_lse_ptr": "*fp32",
                    "seq_lens_ptr": "*i32",
                    "bt_ptr": "*i32",
                    "scale_log2": "fp32",
                    **_i32(
                        *"stride_qt stride_qh stride_bt stride_kp stride_ks stride_kh stride_vp "
                        "stride_vs stride_vh".split()
                    ),
                    **_cx("GROUP", "HEAD_DIM", "PAGE_SIZE", "NUM_SPLITS", "BLOCK_M", "BLOCK_N", "DOT_FP32"),
                },
                {
                    "GROUP": 4,
                    "HEAD_DIM": 64,
                    "PAGE_SIZE": 128,
                    "NUM_SPLITS": 8,
                    "BLOCK_M": 16,
                    "BLOCK_N": 64,
                    "DOT_FP32": fp32,
                },
            )
        )
    out.append(
        (
            "split_reduce",
            D._split_reduce_kernel,
            {
                "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32",
                "out_ptr": "*bf16",
                **_i32("stride_ot", "stride_oh"),
                **_cx("NUM_SPLITS", "SPLITS_P2", "HEAD_DIM"),
            },
            {"NUM_SPLITS": 5, "SPLITS_P2": 8, "HEAD_DIM": 128},
        )
    )
    out.append(
        (
            "apply_bitmask",
            S._apply_bitmask_kernel,
            {"logits_ptr": "*bf16", "bitmask_ptr": "*i32", **_i32("V", "stride_l", "stride_b"), **_cx("BLOCK_V")},
            {"BLOCK_V": 1024},
        )
    )
    for greedy in (False, True):
        for mask in (True, False):
            out.append(
                (
                    f"sample_greedy{int(greedy)}_mask{int(mask)}",
                    S._sample_kernel,
                    {
                        "logits_ptr": "*bf16",
                        "bitmask_ptr": "*i32",
                        "temp_ptr": "*fp32",
                        "top_k_ptr": "*i64",
                        "top_p_ptr": "*fp32",
                        "min_p_ptr": "*fp32",
                        "seeds_ptr": "*i64",
                        "out_ptr": "*i64",
                        **_i32("R", "V", "stride_l", "stride_b"),
                        **_cx("HAS_MASK", "ALL_GREEDY", "BLOCK_R", "BLOCK_V", "SEARCH_BLOCK"),
                    },
                    {"HAS_MASK": mask, "ALL_GREEDY": greedy, "BLOCK_R": 1, "BLOCK_V": 1024, "SEARCH_BLOCK": 256},
                )
            )
    return out


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _frontend(src: ASTSource, target: GPUTarget) -> None:
    """AST -> TTIR only: the stage where the Python-level kernel errors surface."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    options = backend.parse_options(dict(src.parse_options()))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80 or 90")
    ap.add_argument("--frontend-only", action="store_true")
    ap.add_argument("--json", help="write per-kernel results here")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    results, failed = [], 0
    for name, fn, sig, consts in cases():
        t0 = time.perf_counter()
        entry = {"kernel": name}
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            if args.frontend_only:
                _frontend(src, target)
            else:
                k = triton.compile(src, target=target)
                if _cuda_available():
                    k._init_handles()  # loads the cubin: fills in n_regs / n_spills
                entry.update(
                    n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None), shared=k.metadata.shared
                )
            entry["ok"] = True
        except Exception as e:  # report every kernel, not just the first failure
            entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            failed += 1
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(entry)
        print(
            ("OK  " if entry["ok"] else "FAIL")
            + f" {name} ({entry['seconds']}s)"
            + ("" if entry["ok"] else "\n" + entry["error"]),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "frontend_only": args.frontend_only, "kernels": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
