#!/usr/bin/env bash
# Wheels for a GPU machine that has torch, torchvision and timm but none of this project's
# other needs and no package index (the lent H100/H200 image): `.whl/` then travels with the
# working tree and bench/gpu_smoke.sh installs it to /tmp/site. A cluster GPU node uses
# `make setup` instead and needs none of this.
#   bash bench/gpu_wheels.sh            # run here (PyPI reachable), in the repository root
# What the GPU scripts import beyond that image: opacus, dp-accounting (with dm-tree and the
# attrs it pins), jsonschema (config validation, with its three helpers). Versions are the
# ones pinned in requirements.txt / installed in .venv. Snakemake and MLflow are left out
# (bench/gpu_table2.sh runs the Snakemake rules: use a node with the project's venv).
set -euo pipefail  # .whl/ is in .gitignore
cd "$(dirname "$0")/.."
pins=(
  opacus==1.6.0
  dp-accounting==0.6.0
  dm-tree==0.1.10
  attrs==23.2.0
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
)
platforms=()
for n in 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
ls -l .whl
du -sh .whl
