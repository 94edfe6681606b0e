#!/usr/bin/env bash
# GPU smoke test: the tiny pipeline's stages and every DP algorithm on CUDA, checked
# (bench/gpu_smoke.py), then the CUDA tests of the suite (they skip on CPU-only machines).
# Runs unchanged on a cluster GPU node (after `make setup`) and on the lent H100:
#   bash bench/gpu_smoke.sh [OUT_DIR]        # default: $OUT, else results/gpu
# On a machine without the project's venv, wheels carried in .whl/ (bench/gpu_wheels.sh makes
# them) are installed to /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-results/gpu}}"
mkdir -p "$out"
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia_smi.csv"
"$py" bench/gpu_smoke.py --out "$out/gpu_smoke.json"
"$py" -m pytest -q -p no:xdist -p no:cacheprovider tests/test_device.py tests/train/test_batching.py \
  tests/privacy/test_bookkeeping.py \
  2>&1 | tee "$out/gpu_pytest.log"
