# The two quick-start targets (`make demo`, `make test`) and the pieces they are made of.
# Every target sets itself up on a fresh machine; a second run reuses what is cached.
SHELL := /bin/bash
VENV ?= $(or $(OTEL_STRAGGLER_VENV),$(HOME)/.cache/otel-straggler/venv)
PYTHON := $(VENV)/bin/python

.PHONY: venv demo test test-unit lint services-build bench bench-all

venv:
	scripts/setup_venv.sh "$(VENV)"

demo: venv
	$(VENV)/bin/otel-straggler demo $(ARGS)

# the whole suite: unit, protocol and end-to-end tests, with the real collector, Jaeger and
# Prometheus built (cached) here and started by the pipeline tests on free ports
test: venv services-build
	scripts/run_tests.sh "$(VENV)" $(ARGS)

# without the services: what runs in seconds while editing
test-unit: venv
	$(PYTHON) -m pytest -q -m "not services and not slow" $(ARGS)

# ruff and mypy on the package (settings in pyproject.toml); `make test` runs them first too
lint: venv
	scripts/lint.sh "$(VENV)"

services-build:
	scripts/services.sh build

# `make bench` lists the benchmarks (benchmarks/catalog.py); `make bench NAME=hot_path ARGS="--rounds 3"` runs one
bench: venv
	$(PYTHON) benchmarks/catalog.py $(if $(NAME),run $(NAME) $(ARGS))

# every CPU benchmark in turn with short settings: that each still runs, not figures to quote
bench-all: venv services-build
	$(PYTHON) benchmarks/catalog.py all
