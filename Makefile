# The two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.runtime-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.runtime-installed

demo: $(VENV)/.runtime-installed
	$(BIN)/kvgate demo

test: $(VENV)/.dev-installed
	$(BIN)/ruff check kvgate tests benchmarks
	$(BIN)/ruff format --check kvgate tests benchmarks
	$(BIN)/python -m pytest

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check kvgate tests benchmarks
	$(BIN)/ruff format --check kvgate tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
