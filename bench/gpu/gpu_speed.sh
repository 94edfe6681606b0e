#!/usr/bin/env bash
# Issue 12's speed figures on a GPU node: every per-sample clipping mode against the non-private
# step (bench/cpu/dp_modes.py), on CUDA (all models, peak GPU memory) and on the node's CPU (the
# embedded CNN and ResNet20-GN, the CPU targets), each with the clipped-sum correctness check.
#
#   bench/gpu/gpu_speed.sh [OUTDIR]      # default: $OUT, else bench-results/<host>-<UTC time>
#
# Environment: PYTHON (default .venv/bin/python, else python3 + .whl/), STEPS (CUDA, default 20),
# CPU=1 (also the node's CPU part: a minute that says nothing about the GPU, off by default),
# CPU_STEPS (default 10), CPU_MODELS, CUDA_MODELS, TINY=1 (smoke run of this script),
# ALLOW_NO_CUDA=1 (CPU part only). Writes OUTDIR/{cuda,cpu}/dp_modes.{json,md}, the logs and
# nvidia-smi's view of the node. Run nothing else on the node meanwhile. The lent machine's one
# command is bench/gpu/gpu_session.sh, which runs the CUDA part of this (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-bench-results/$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)}}"
# shellcheck source=bench/gpu/gpu_env.sh
source bench/gpu/gpu_env.sh
mkdir -p "$out"
extra=()
[ -n "${TINY:-}" ] && extra=(--tiny)  # smoke run of the script itself; timings mean nothing
rc=0
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
  # shellcheck disable=SC2086
  "$py" bench/cpu/dp_modes.py --device cuda --steps "${STEPS:-20}" "${extra[@]}" \
    --models ${CUDA_MODELS:-resnet20-gn gnresnet10 cnn-gn dpnas-mnist} --out "$out/cuda" \
    2>&1 | tee "$out/cuda.log" || rc=1
elif [ -z "${ALLOW_NO_CUDA:-}" ]; then
  echo "error: torch sees no CUDA device (set ALLOW_NO_CUDA=1 to run the CPU part only)" >&2
  exit 2
fi
cuda=1
"$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || cuda=0
if [ -n "${CPU:-}" ] || [ "$cuda" = 0 ]; then
# shellcheck disable=SC2086
"$py" bench/cpu/dp_modes.py --device cpu --steps "${CPU_STEPS:-10}" --warmup 2 "${extra[@]}" \
  --models ${CPU_MODELS:-cnn-gn resnet20-gn} --out "$out/cpu" 2>&1 | tee "$out/cpu.log" || rc=1
fi
echo "results in $out"
exit "$rc"
