#!/usr/bin/env bash
# The pipeline's GPU checks in one command for one short allocation (docs/gpu.md):
#   bash bench/gpu/gpu_session.sh                    # on a GPU: at most 8 files in $OUT
#   bash bench/gpu/gpu_session.sh --dry-run OUTDIR   # every step at tiny size on the CPU
# Further options go to bench/gpu/gpu_session.py (--deadline S, --only STEP..., --work DIR).
# Runs unchanged on a cluster GPU node (the project's venv) and on the bare lent image with
# the folders bench/gpu/gpu_wheels.sh prepares (.whl/, .fmnist/) carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
args=()
if [ "${1:-}" = "--dry-run" ]; then
  [ $# -ge 2 ] || { sed -n '2,4p' "$0"; exit 2; }
  args=(--dry-run --out "$2")
  shift 2
fi
# shellcheck source=bench/gpu/gpu_env.sh
source bench/gpu/gpu_env.sh || exit 1
exec "$py" bench/gpu/gpu_session.py "${args[@]}" "$@"
