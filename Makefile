# pdserve: `make up` installs and runs everything; `make test` installs and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= cpu,dev
PYTEST_ARGS ?=
# Test files run on this many pytest processes (a file's tests stay together, so module
# fixtures are built once); 1 runs them in this process.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)
# mypy reads the packages as installed (pdserve.api is api/, ...) from a tree of links.
TYPECHECK_DIR := build/typecheck
SUBPACKAGES := schemas broker engine api workers
SHELL := /bin/bash
space := $() $()

.PHONY: install up test test-fast test-gpu lint typecheck bench clean

install: $(VENV)/.installed

# $(call debian,PACKAGE,COMMAND,WHY): installs Debian's PACKAGE unless the shell test COMMAND passes.
debian = if ! { $(2); }; then \
	  echo "installing Debian's $(1) ($(3))"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml Makefile
	@$(call debian,libibverbs1,/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ',needed by the Mooncake wheel)
	@$(call debian,gcc,command -v cc >/dev/null || command -v gcc >/dev/null,the CPU pass builds its attention kernels with it)
	@$(call debian,chromium,command -v chromium >/dev/null,the dashboard test loads /dashboard in it headless)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

up: install
	$(BIN)/pdserve up $(ARGS)

test: lint
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

lint: install typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	rm -rf $(TYPECHECK_DIR) && mkdir -p $(TYPECHECK_DIR)/pdserve
	ln -s $(CURDIR)/pdserve/*.py $(CURDIR)/pdserve/bench $(TYPECHECK_DIR)/pdserve/
	for d in $(SUBPACKAGES); do ln -s $(CURDIR)/$$d $(TYPECHECK_DIR)/pdserve/$$d; done
	set -o pipefail; cd $(TYPECHECK_DIR) && \
	  $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/.mypy_cache -p pdserve \
	  | sed -E 's#^pdserve/($(subst $(space),|,$(SUBPACKAGES)))/#\1/#'

bench: install
	$(BIN)/python bench/engine_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache $(TYPECHECK_DIR)

# On a machine with a CUDA device: the kernels compiled, graphs against eager, float32 against transformers.
test-gpu: install
	$(BIN)/python -m pytest -q tests/engine/test_kernels.py tests/engine/test_fast_model.py tests/engine/test_gpu.py
