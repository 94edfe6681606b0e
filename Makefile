# Two commands do all set-up: `make run` and `make test`. Both create and reuse .venv/.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= 2
CONFIG ?= config.yaml

.PHONY: run sweeps hpo federated test test-cluster lint bench setup data clean-results

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP) data

# Fashion-MNIST ships as a Debian package; install it when missing and apt is usable.
data:
	@if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null || echo "warning: could not install dataset-fashion-mnist"; fi

run: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete
	@cat results/summary/finetune.md

# gamma sweeps of SAM and DPAdapter (Figs. 5-6 analogues); not part of `make run`.
sweeps: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete sweeps
	@ls results/figures/

# Private HPO (linear scaling rule vs. random search vs. grid oracle); not part of `make run`.
hpo: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete hpo
	@cat results/summary/hpo.md

# DP federated fine-tuning, Pretrain-DPFL (strategies x mechanisms x eps); not part of `make run`.
federated: setup
	$(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG) --rerun-incomplete federated
	@cat results/summary/federated.csv
	@$(BIN)/python -c "import json; r = json.load(open('results/summary/federated_rule.json')); print(f\"T1 rule: {r['hits']}/{r['n_cells']} cells predicted the HT/FT winner\")"

# The whole suite, tests/cluster included (a real one-node Slurm, DVC round trip, MLflow under
# load, SIGKILL resume). Two xdist workers, one test file per worker at a time: the cluster tests
# mostly wait on daemons and subprocesses, so the suite takes about half its serial time.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-cluster: setup
	$(BIN)/python -m pytest -q tests/cluster

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

bench: setup
	$(BIN)/python bench/dp_step.py

clean-results:
	rm -rf results logs benchmarks
