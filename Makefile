# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install the package with its extras. torch is pinned to the
# CPU build (constraints-cpu.txt) only when the venv has no torch yet, so a venv that already
# holds a CUDA build keeps it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PIP_FLAGS ?= --quiet --disable-pip-version-check
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-all demo bench clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints-cpu.txt
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(PIP_FLAGS) -c constraints-cpu.txt torch
	$(PY) -m pip install $(PIP_FLAGS) -e ".[test,bench]"
	@touch $(STAMP)

# Whole suite, Triton kernels under the interpreter when there is no GPU (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q -ra

# Kernel microbenchmarks; writes docs/results/kernels_<device>.json and prints the table.
bench: $(STAMP)
	$(PY) -m bench.kernels --out docs/results

# Main job. Until the trainer exists it runs the kernel microbenchmarks (short rounds) and prints the table.
demo: $(STAMP)
	$(PY) -m bench.kernels --quick --out build/demo

clean:
	rm -rf $(VENV) build .pytest_cache .benchmarks
