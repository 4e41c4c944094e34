# Every target sets itself up: a fresh clone needs only Python 3.10-3.13 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Whole test files run on this many workers: the real servers' start-up overlaps the
# simulated-server tests' waiting.
PYTEST_WORKERS ?= 2
.DEFAULT_GOAL := test

.PHONY: demo test test-fast lint bench clean tools

# Tools the tests need beyond Python packages: promtool and prometheus (make/prometheus.mk),
# Chromium for the incident report's browser test (make/chromium.mk), and the CPU builds of
# vLLM and vLLM-Omni in their own environments for the real-server tests (make/vllm.mk,
# make/omni.mk), and iproute2 and nftables for the partition tests' lab hosts
# (make/netlab.mk).
-include make/*.mk

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/omni-watchdog demo

lint: $(STAMP)
	$(BIN)/ruff check omni_watchdog tests benchmarks dashboards deploy scripts
	$(BIN)/ruff format --check omni_watchdog tests benchmarks dashboards deploy scripts
	$(BIN)/mypy omni_watchdog
	MYPYPATH=tests $(BIN)/mypy --strict --explicit-package-bases tests

test: lint tools
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The unit tier, for your own loop: nothing marked e2e and neither real-server folder, so
# no lint and no tools to install; under a minute on two cores. Tests go to the workers
# one at a time rather than by file: the files are too uneven to balance whole.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not e2e" --ignore=tests/real_omni --ignore=tests/real_vllm \
		-n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

tools:
