#!/usr/bin/env bash
# GPU smoke test: every part runs even when an earlier one fails, and the summary lists each
# failure; exit 1 if any part failed.
#   1. bench/gpu/gpu_smoke.py: every DP algorithm in every per-sample mode (hooks, ew, functorch, bk)
#      on CUDA, checked (device, padded shapes, finite weights, accuracy, measured noise,
#      epsilon, deterministic repeat), then warm-up and DPAdapter;
#   2. the suite's CUDA tests (they skip on CPU-only machines, so CI never runs them): the DP
#      jobs on CUDA with resume, padding, bk's clipped sum on the GPU against the CPU reference.
# Runs unchanged on a cluster GPU node (after `make setup`) and on a bare GPU image with the
# carried .whl/ and .fmnist/ (bench/gpu/gpu_wheels.sh; docs/gpu.md has the device command line):
#   bash bench/gpu/gpu_smoke.sh [OUT_DIR]        # default: $OUT, else results/gpu
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-results/gpu}}"
mkdir -p "$out"
# shellcheck source=bench/gpu/gpu_env.sh
source bench/gpu/gpu_env.sh || exit 1
failed=()
part() {  # part NAME LOG COMMAND...: run, tee its output to LOG, remember a failure
  local name=$1 log=$2
  shift 2
  echo "=== $name"
  if "$@" 2>&1 | tee "$log"; then echo "=== $name: passed"; else
    echo "=== $name: FAILED"
    failed+=("$name")
  fi
}
part nvidia-smi "$out/nvidia_smi.csv" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
part gpu_smoke.py "$out/gpu_smoke.log" "$py" bench/gpu/gpu_smoke.py --out "$out/gpu_smoke.json"
part cuda-tests "$out/gpu_pytest.log" "$py" -m pytest -q -p no:xdist -p no:cacheprovider -rs \
  tests/ground/test_device.py tests/train/test_batching.py tests/per_sample/test_bookkeeping.py
if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu_smoke.sh: ${#failed[@]} part(s) FAILED: ${failed[*]} (logs in $out)"
  exit 1
fi
echo "gpu_smoke.sh: every part passed (logs in $out)"
