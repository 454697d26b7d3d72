# The two set-up commands on a fresh machine: `make demo` and `make test`.
# Installs are pinned by constraints.txt (`make constraints` refreshes it).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8080
PIP_INSTALL := $(BIN)/python -m pip install -q -c constraints.txt

.PHONY: demo test lint constraints clean

# LiteLLM's proxy for the overhead benchmark's peer column, in a virtualenv of its own (its pins
# clash with kvgate's); not part of the set-up.
LITELLM_VERSION ?= 1.108.7
.venv-litellm/bin/litellm:
	$(PYTHON) -m venv .venv-litellm
	.venv-litellm/bin/python -m pip install -q 'litellm[proxy]==$(LITELLM_VERSION)'

.venv-litellm: .venv-litellm/bin/litellm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.runtime-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]'
	touch $@ $(VENV)/.runtime-installed

demo: $(VENV)/.runtime-installed
	$(BIN)/kvgate demo --port $(PORT)

# Lint, format and type checks (mypy over kvgate/), the test suite, then the container image's install steps in
# a fresh virtualenv (scripts/install-check.sh: no container engine needed).
test: $(VENV)/.dev-installed
	$(BIN)/ruff check kvgate tests benchmarks
	$(BIN)/ruff format --check kvgate tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest
	scripts/install-check.sh

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check kvgate tests benchmarks
	$(BIN)/ruff format --check kvgate tests benchmarks

# Resolve every runtime and dev dependency afresh (newest releases allowed by pyproject.toml)
# in a throwaway virtualenv and pin what was installed. Commit the result with the change
# that needed it; the image, CI and the targets above then install exactly these versions.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade pip
	.venv-constraints/bin/python -m pip install -q '.[dev]'
	{ echo '# Pinned versions of every runtime and dev dependency of kvgate, as resolved by'; \
	  echo '# `make constraints` (pip install ".[dev]" in a fresh virtualenv, then pip freeze).'; \
	  echo '# Used as `pip install -c constraints.txt ...` by the Makefile and the Dockerfile.'; \
	  .venv-constraints/bin/python -m pip freeze --exclude kvgate; } > constraints.txt
	rm -rf .venv-constraints

clean:
	rm -rf $(VENV) .venv-constraints .venv-litellm build *.egg-info
