#!/usr/bin/env bash
# DP-SAT Table 3's backbones on one GPU: seconds per DP step (bk; fp32 and bf16), peak memory and
# the projected device-hours of configs/dpsat-table3.yaml (bench/gpu/gpu_external_timing.py).
#   bash bench/gpu/gpu_external.sh            # writes $OUT/external_timing.json (or results/gpu/)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/gpu/gpu_env.sh
source bench/gpu/gpu_env.sh
out="${OUT:-results/gpu}"
"$py" bench/gpu/gpu_external_timing.py --modes bk,functorch --precisions fp32,bf16 \
  --out "$out/external_timing.json"
