#!/usr/bin/env bash
# What a GPU machine without a package index and without Debian's Fashion-MNIST needs beyond
# its image's torch, torchvision and timm (the lent H100/H200): `.whl/` (wheels) and `.fmnist/`
# (the four .gz files). Both travel with the working tree as carried paths and
# bench/gpu_env.sh uses them. A cluster GPU node uses `make setup` instead and needs neither.
#   bash bench/gpu_wheels.sh            # run here (PyPI reachable), in the repository root
# What the GPU scripts import beyond that image: opacus, dp-accounting (with dm-tree),
# jsonschema (config validation, with its three helpers). attrs, numpy, scipy, PyYAML,
# matplotlib and pytest are in the image and are not carried (docs/gpu.md). Versions are the
# ones pinned in requirements.txt / installed in .venv. Snakemake and MLflow are left out: the
# GPU scripts call the stage entry points directly and tracking is off without MLflow.
set -euo pipefail  # .whl/ and .fmnist/ are in .gitignore
cd "$(dirname "$0")/.."
pins=(
  opacus==1.6.0
  dp-accounting==0.6.0
  dm-tree==0.1.10
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
src=${FMNIST_SRC:-/usr/share/datasets/fashion-mnist}
mkdir -p .fmnist
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  cp "$src/$f.gz" .fmnist/
done
du -sh .whl .fmnist
