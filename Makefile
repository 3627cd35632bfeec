# pdserve: `make up` installs and runs everything; `make test` installs and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= cpu,dev
PYTEST_ARGS ?=

.PHONY: install up test test-fast test-gpu lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  echo "installing Debian's libibverbs1 (needed by the Mooncake wheel)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 >/dev/null; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

up: install
	$(BIN)/pdserve up $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy schemas broker api

bench: install
	$(BIN)/python bench/engine_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

# On a machine with a CUDA device: the kernels compiled, graphs against eager, float32 against transformers.
test-gpu: install
	$(BIN)/python -m pytest -q tests/engine/test_kernels.py tests/engine/test_fast_model.py tests/engine/test_gpu.py
