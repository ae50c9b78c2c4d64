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
#   benchmarks/gpu_check.sh --cpu-smoke   # CPU, TRITON_INTERPRET=1, tiny sizes: checks this script
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0; E2E=all
for a in "$@"; do
  case "$a" in
    --cpu-smoke) SMOKE=1 ;;
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
export OUT=${OUT:-benchmarks/results/out}
mkdir -p "$OUT"
export TRITON_DEFAULT_FP_FUSION=1
status=0
step() { echo; echo "=== $*"; }
run() { "$@"; local rc=$?; if [ $rc -ne 0 ]; then echo "FAILED (rc=$rc): $*"; status=1; fi; return 0; }

if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1
  step "kernel tests (CPU, interpreter)"
  run "$PY" -m pytest -q tests/kernel
  step "gpu_kernels.py --cpu-smoke"
  run "$PY" benchmarks/gpu_kernels.py --cpu-smoke
  step "compile check, frontend only (no GPU needed)"
  TRITON_INTERPRET=0 run "$PY" benchmarks/compile_check.py --frontend-only --arch 90 --json "$OUT/compile_check.json"
  step "gpu_correctness.py on a tiny config (CPU): engine vs HF greedy, chunked prefill, preemption, prefix cache, grammars"
  TRITON_INTERPRET=0 run "$PY" benchmarks/gpu_correctness.py --config tiny-llama --device cpu --dtype float32
  step "gpu_e2e.py on a tiny config (CPU, torch kernels)"
  if "$PY" -c "from constrained_serve import Engine" 2>/dev/null; then
    TRITON_INTERPRET=0 run "$PY" benchmarks/gpu_e2e.py --config tiny-llama --num-requests 6 --prompt-len 8 \
      --output-len 5 --device cpu --dtype float32 --kernels torch
  else
    echo "constrained_serve.Engine is not importable here yet: checking the script parses only"
    run "$PY" benchmarks/gpu_e2e.py --help >/dev/null
  fi
  echo; [ $status = 0 ] && echo "cpu smoke: OK" || echo "cpu smoke: FAILED"
  exit $status
fi

unset TRITON_INTERPRET
step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))" || exit 1
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)")

step "compile check sm_$ARCH (registers, spills)"
run "$PY" benchmarks/compile_check.py --arch "$ARCH" --json "$OUT/compile_check.json"

step "correctness first: engine vs HF greedy on the same weights (std 0.2), Llama-3.2-1B shape, llama3 rope"
run "$PY" benchmarks/gpu_correctness.py --config llama-3.2-1b --dtype float32
run "$PY" benchmarks/gpu_correctness.py --config llama-3.2-1b --dtype bfloat16

step "kernels vs references on CUDA, and timings"
run "$PY" benchmarks/gpu_kernels.py

if [ "$E2E" != none ]; then
  configs="llama-3.2-1b"
  [ "$E2E" = all ] && configs="llama-3.2-1b llama-3.1-8b"
  for c in $configs; do
    step "end to end: $c, 256 requests"
    run "$PY" benchmarks/gpu_e2e.py --config "$c" --num-requests 256 --prompt-len 128 --output-len 128
  done
fi

echo; ls -l "$OUT"
[ $status = 0 ] && echo "gpu check: OK" || echo "gpu check: FAILED"
exit $status
