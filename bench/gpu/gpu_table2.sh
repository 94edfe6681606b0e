#!/usr/bin/env bash
# One cell of DP-SAT Table 2 (Fashion-MNIST, from scratch) per call on one GPU, without
# Snakemake: the pretrain/finetune stage entry points, then the paper-vs-ours table over every
# finished cell (bench/gpu/gpu_table2.py). Finished cells are reused; the tables go to $OUT too.
#   bash bench/gpu/gpu_table2.sh CONFIG ALGO EPS [SEED]
#   bash bench/gpu/gpu_table2.sh configs/dpsat-table2.yaml dpsgd 1 0
# The whole table on a cluster: snakemake --profile slurm --configfile configs/dpsat-table2.yaml
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 3 ]; then sed -n '2,7p' "$0"; exit 2; fi
# shellcheck source=bench/gpu/gpu_env.sh
source bench/gpu/gpu_env.sh
out="${OUT:-results/gpu}"
"$py" bench/gpu/gpu_table2.py --config "$1" --algo "$2" --eps "$3" --seed "${4:-0}" --out "$out"
