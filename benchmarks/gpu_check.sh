#!/usr/bin/env bash
# GPU check for the Triton kernels, runnable as is on a CUDA machine without network:
#   0. correctness: engine vs HF greedy, token for token (gpu_correctness.py),
#   1. compile every kernel for this GPU's arch (registers / spills / shared memory),
#   2. kernels vs torch references on CUDA, and timings vs SDPA / torch sampling,
#   3. end to end: Engine vs HF generate, Llama-3.2-1B and Llama-3.1-8B shapes, 256 requests.
# JSON goes to $OUT (default benchmarks/results/out) and benchmarks/results/<date>-<gpu>.json.
#
#   benchmarks/gpu_check.sh               # everything
#   benchmarks/gpu_check.sh --no-e2e      # kernels only
#   benchmarks/gpu_check.sh --e2e-small   # e2e on the 1B shape only
#   benchmarks/gpu_check.sh --quick       # the lent-GPU run, about 6 min: correctness, kernels, 1B e2e with
#                                         # CUDA graphs on and off, and the pipelined loop off, structured
#                                         # extraction (gpu_structured.py)
#   benchmarks/gpu_check.sh --quick-1     # its first half (compile, correctness, kernels, sweep; <= 510 s)
#   benchmarks/gpu_check.sh --quick-2     # its second half (end to end, structured; <= 390 s): two device
#                                         # calls that each fit the 600 s a call may run, whatever happens
#   benchmarks/gpu_check.sh --cpu-smoke   # CPU, TRITON_INTERPRET=1, tiny sizes: checks this script
# A machine without network first gets .whl/ and .gpu/tokenizer/ from benchmarks/gpu_prepare.sh.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0; E2E=all; QUICK=0; HALVES="1 2"
for a in "$@"; do
  case "$a" in
    --cpu-smoke) SMOKE=1 ;;
    --quick) QUICK=1 ;;
    --quick-1) QUICK=1; HALVES=1 ;;
    --quick-2) QUICK=1; HALVES=2 ;;
    --no-e2e) E2E=none ;;
    --e2e-small) E2E=small ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
fi
# The SmolLM2 tokenizer for the checks that build models: the default model's folder when it is
# installed, else the copy gpu_prepare.sh makes.
if [ -z "${CS_TOKENIZER_DIR:-}" ] && [ -f .gpu/tokenizer/tokenizer.json ]; then export CS_TOKENIZER_DIR=$PWD/.gpu/tokenizer; fi
export OUT=${OUT:-benchmarks/results/out}
mkdir -p "$OUT"
export TRITON_DEFAULT_FP_FUSION=1
status=0
step() { echo; echo "=== $* (${SECONDS}s into the check)"; }
run() { "$@"; local rc=$?; if [ $rc -ne 0 ]; then echo "FAILED (rc=$rc): $*"; status=1; fi; return 0; }

if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1
  step "kernel tests (CPU, interpreter)"
  run "$PY" -m pytest -q tests/kernel
  step "gpu_kernels.py --cpu-smoke"
  run "$PY" benchmarks/gpu_kernels.py --cpu-smoke
  run "$PY" benchmarks/gpu_kernels.py --cpu-smoke --sweep-only
  step "compile check, frontend only (no GPU needed)"
  TRITON_INTERPRET=0 run "$PY" benchmarks/compile_check.py --frontend-only --arch 90 --json "$OUT/compile_check.json"
  step "gpu_correctness.py on a tiny config (CPU): engine vs HF greedy, chunked prefill, preemption, prefix cache, grammars"
  TRITON_INTERPRET=0 run "$PY" benchmarks/gpu_correctness.py --config tiny-llama --device cpu --dtype float32
  step "gpu_structured.py on a tiny config (CPU)"
  TRITON_INTERPRET=0 run "$PY" benchmarks/gpu_structured.py --config tiny-llama --device cpu --dtype float32 \
    --num-requests 4 --max-tokens 32 --repeats 1 --skip-hf
  step "gpu_e2e.py on a tiny config (CPU, torch kernels)"
  if "$PY" -c "from constrained_serve import Engine" 2>/dev/null; then
    # Plain torch linears: the CPU default prepacks the weights for oneDNN, out of the reach of
    # the weight copy into HF's model, and the greedy match against HF would be skipped.
    CONSTRAINED_SERVE_CPU_LINEAR=torch TRITON_INTERPRET=0 run "$PY" benchmarks/gpu_e2e.py --config tiny-llama \
      --num-requests 6 --prompt-len 8 --output-len 5 --device cpu --dtype float32 --kernels torch
  else
    echo "constrained_serve.Engine is not importable here yet: checking the script parses only"
    run "$PY" benchmarks/gpu_e2e.py --help >/dev/null
  fi
  step "summary against the targets"
  run "$PY" benchmarks/gpu_summary.py "$OUT"
  echo; [ $status = 0 ] && echo "cpu smoke: OK" || echo "cpu smoke: FAILED"
  exit $status
fi

unset TRITON_INTERPRET
step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))" || exit 1
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)")

if [ "$QUICK" = 1 ]; then
  # Each step has a time limit, so one slow step cannot eat a 15-minute lease.
  if [[ " $HALVES " == *" 1 "* ]]; then
  step "compile check sm_$ARCH"
  run timeout 90 "$PY" benchmarks/compile_check.py --arch "$ARCH" --json "$OUT/compile_check.json"
  step "correctness: engine (CUDA graphs on, and off for comparison) vs HF greedy, 1B shape, fp32 then bf16"
  run timeout 150 "$PY" benchmarks/gpu_correctness.py --config llama-3.2-1b --dtype float32 --num-requests 16
  run timeout 90 "$PY" benchmarks/gpu_correctness.py --config llama-3.2-1b --dtype bfloat16 --num-requests 16 --skip-grammar
  step "kernels vs references, timings"
  run timeout 90 "$PY" benchmarks/gpu_kernels.py --repeats 20 --warmup 5
  step "attention launch settings against SDPA (to choose this GPU's defaults)"
  run timeout 90 "$PY" benchmarks/gpu_kernels.py --sweep-only --repeats 10 --warmup 3
  fi
  if [[ " $HALVES " == *" 2 "* ]]; then
  step "end to end, 1B shape, 256 x 128/128: CUDA graphs on (vs HF), then off, then the pipelined loop off"
  run timeout 120 "$PY" benchmarks/gpu_e2e.py --config llama-3.2-1b
  run timeout 60 "$PY" benchmarks/gpu_e2e.py --config llama-3.2-1b --no-cuda-graphs --skip-hf
  run timeout 60 "$PY" benchmarks/gpu_e2e.py --config llama-3.2-1b --no-pipeline --skip-hf
  step "structured extraction, SmolLM2-1.7B shape, 256 requests"
  run timeout 150 "$PY" benchmarks/gpu_structured.py --repeats 1
  fi
  echo; ls -l "$OUT"
  step "summary against the targets"
  "$PY" benchmarks/gpu_summary.py "$OUT"
  [ $status = 0 ] && echo "gpu check --quick: OK" || echo "gpu check --quick: FAILED"
  exit $status
fi

step "compile check sm_$ARCH (registers, spills)"
run "$PY" benchmarks/compile_check.py --arch "$ARCH" --json "$OUT/compile_check.json"

step "correctness first: engine vs HF greedy on the same weights (std 0.2), Llama-3.2-1B shape, llama3 rope"
run "$PY" benchmarks/gpu_correctness.py --config llama-3.2-1b --dtype float32
run "$PY" benchmarks/gpu_correctness.py --config llama-3.2-1b --dtype bfloat16

step "kernels vs references on CUDA, timings, and the attention's launch settings"
run "$PY" benchmarks/gpu_kernels.py --sweep

if [ "$E2E" != none ]; then
  configs="llama-3.2-1b"
  [ "$E2E" = all ] && configs="llama-3.2-1b llama-3.1-8b"
  for c in $configs; do
    step "end to end: $c, 256 requests"
    run "$PY" benchmarks/gpu_e2e.py --config "$c" --num-requests 256 --prompt-len 128 --output-len 128
    run "$PY" benchmarks/gpu_e2e.py --config "$c" --num-requests 256 --prompt-len 128 --output-len 128 \
      --no-cuda-graphs --skip-hf
    run "$PY" benchmarks/gpu_e2e.py --config "$c" --num-requests 256 --prompt-len 128 --output-len 128 \
      --no-pipeline --skip-hf
  done
  step "structured extraction, SmolLM2-1.7B shape, 256 requests"
  run "$PY" benchmarks/gpu_structured.py --repeats 3
fi

echo; ls -l "$OUT"
step "summary against the targets"
"$PY" benchmarks/gpu_summary.py "$OUT"
[ $status = 0 ] && echo "gpu check: OK" || echo "gpu check: FAILED"
exit $status
