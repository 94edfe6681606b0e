# Two commands do all set-up: `make run` and `make test`. Both create and reuse .venv/.
# `make check` is the edit loop's subset of `make test` (docs/testing.md).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= 2
CONFIG ?= config.yaml
# The results folder of $(CONFIG) (its `results_dir`, from its `base:` when it names none), for
# the summaries printed below.
RESULTS = $$($(BIN)/python -c "import sys; from dpadapter.settings import read_raw; print(read_raw(sys.argv[1]).get('results_dir', 'results'))" $(CONFIG))

.PHONY: run report sweeps hpo federated audit validity check test test-cluster lint bench overhead setup data browser clean-results mlflow

# uv installs the pinned set several times faster than pip (parallel downloads and unpacking);
# pip is the fallback where uv cannot be had or fails. uv ignores pip's configuration, so
# tools/uv_pip_args.py hands it pip's find-links / indexes (the local torch CPU wheel here).
# --compile-bytecode as pip does: otherwise the first jobs each compile the .pyc files.
PIP_INSTALL := $(BIN)/pip install -q --disable-pip-version-check
UV_INSTALL = UV_LINK_MODE=copy $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python \
	$$($(BIN)/python tools/uv_pip_args.py $(BIN)/pip)
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if $(PIP_INSTALL) uv 2>/dev/null && $(UV_INSTALL) -r requirements.txt \
	    && $(UV_INSTALL) --no-deps --no-build-isolation -e .; then :; else \
	  echo "uv unavailable or failed: installing with pip"; \
	  $(PIP_INSTALL) -r requirements.txt \
	    && $(PIP_INSTALL) --no-deps --no-build-isolation -e .; fi
	$(BIN)/python tools/install_compat_pth.py  # plain `import timm` works in the venv
	touch $(STAMP)

setup: $(STAMP) data

# Fashion-MNIST ships as a Debian package; install it when missing and apt is usable.
data:
	@if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null || echo "warning: could not install dataset-fashion-mnist"; fi

# Headless Chromium, with which the tests open the Snakemake report (tests/workflow/
# test_snakemake.py); Debian's package, installed when missing and apt is usable, as for the
# dataset. Only `make test` needs it. Where it cannot be installed, the reason goes to
# $(VENV)/.no-chromium and the browser test skips with it (without that file it fails).
browser: $(STAMP)
	@rm -f $(VENV)/.no-chromium; if command -v chromium >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null \
	    || { echo "warning: could not install chromium (the report's browser test will skip)"; \
	         echo "apt-get install chromium failed" > $(VENV)/.no-chromium; }; \
	else echo "warning: chromium is missing and apt is not usable here (not root): the report's browser test will skip"; \
	  echo "chromium is missing and apt-get is not usable (not root)" > $(VENV)/.no-chromium; fi

# A config with a published table (`reference:`, e.g. configs/dpsat-table3.yaml) prints it too.
run: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete
	@R=$(RESULTS); cat $$R/summary/finetune.md; if [ -f $$R/summary/reference.md ]; then cat $$R/summary/reference.md; fi

# The Snakemake report of $(CONFIG): every summary table and figure made so far (the main grid, run
# first if missing; HPO, federated, audit, validity and sweeps once run), with captions.
report: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete report_all
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --report $(RESULTS)/report.html report_all
	@echo "report: $(RESULTS)/report.html"

# gamma sweeps of SAM and DPAdapter (Figs. 5-6 analogues); not part of `make run`.
sweeps: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete sweeps
	@ls $(RESULTS)/figures/

# Private HPO (linear scaling rule vs. random search vs. grid oracle); not part of `make run`.
hpo: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete hpo
	@cat $(RESULTS)/summary/hpo.md

# DP federated fine-tuning, Pretrain-DPFL (strategies x mechanisms x eps); not part of `make run`.
federated: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete federated
	@cat $(RESULTS)/summary/federated.md
	@R=$(RESULTS); $(BIN)/python -c "import json, sys; r = json.load(open(sys.argv[1] + '/summary/federated_rule.json')); c = r.get('hit_rate_interval') or {}; print(f\"T1 rule: {r['hits']}/{r['n_cells']} cells predicted the HT/FT winner; 95% Wilson [{c.get('low', float('nan')):.2f}, {c.get('high', float('nan')):.2f}] vs always-HT {r.get('always_ht', float('nan')):.2f}, always-FT {r.get('always_ft', float('nan')):.2f}, coin 0.50\")" "$$R"

# Empirical privacy audit: every registered algorithm x audit.epsilons, one canary run each, a
# one-run lower bound on epsilon (docs/audit.md); not part of `make run`.
audit: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete audit
	@cat "$$($(BIN)/python -c "from dpadapter.settings import load; print(load('$(CONFIG)').results_dir)")/summary/audit.md"

# One page of findings: each paper's claim tested in its own regime (docs/validity.md). Runs the
# main grid, the HPO and the federated grid first if they are missing; not part of `make run`.
validity: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete validity
	@cat $(RESULTS)/summary/validity.md

# pytest with Python's bytecode caches on, where the environment turns them off
# (PYTHONDONTWRITEBYTECODE, as container images often do): without them each xdist worker
# re-reads and assertion-rewrites every test module at every run (`make check`'s collection
# 10.6-11.2 s -> 7.8 s, docs/measured.md). The caches go to __pycache__/ (git-ignored).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# The fast tier, for the edit loop: the tests marked neither `process` nor `slow`, so none that
# starts Snakemake, Slurm, DVC, torchrun, a server, a fork server or any other process (one that
# does, unmarked, fails: tests/process_guard.py) and none that takes long. `make test` (all of
# them) before committing (docs/testing.md).
check: setup
	$(PYTEST) -q -n 2 --dist loadfile -m "not process and not slow" --durations=10

# The whole suite, tests/cluster included (a real one-node Slurm, DVC round trip, MLflow under
# load, SIGKILL resume). Two xdist workers, one test file per worker at a time: the cluster tests
# mostly wait on daemons and subprocesses, so the suite takes about half its serial time. The
# longest files are handed out first (tests/longest_first.py), so both workers finish together.
# The 30 slowest tests are listed at the end of every run (docs/measured.md says what each proves).
test: setup browser
	$(PYTEST) -q -n 2 --dist loadfile --durations=30

test-cluster: setup
	$(PYTEST) -q tests/cluster

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

bench: setup
	$(BIN)/python bench/cpu/dp_step.py

# Where the time of $(CONFIG)'s finished run went: per rule, wall per job (Snakemake benchmark
# files) against the training time inside it (metrics.json), and one timed dry run of the config
# (docs/speed.md). Reads the results, writes nothing there.
overhead: $(STAMP)
	$(BIN)/python bench/cpu/overhead.py $(RESULTS) --dry-run-config $(CONFIG)

# The MLflow UI over the runs of $(CONFIG) (its results folder's store unless MLFLOW_TRACKING_URI
# or tracking.uri say otherwise), opened on the config's experiment in the "DP runs" view; with a
# tracking server, that view's URL on the server. PORT=5001 if 5000 is taken.
PORT ?= 5000
mlflow: $(STAMP)
	$(BIN)/python -m dpadapter.tracking $(CONFIG) --serve --port $(PORT)

clean-results:
	rm -rf results logs benchmarks
