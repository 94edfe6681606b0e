#!/usr/bin/env bash
# DP-SAT Table 2 (Fashion-MNIST, from scratch) cells on one GPU, through the pipeline's own
# Snakemake rules, then the paper-vs-ours table and each run's wall time.
#   bash bench/gpu_table2.sh [CONFIG] [ALGOS] [EPSILONS] [SEEDS]
#   bash bench/gpu_table2.sh configs/dpsat-table2.yaml "dpsgd dpsat" "1 3" "0"   # the minimum
# Defaults: configs/dpsat-table2.yaml, all its algorithms, epsilons and seeds (the whole
# table; on a cluster use `snakemake --profile slurm --configfile configs/dpsat-table2.yaml`).
# Results go to the config's results_dir; the summary and timings are also copied to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-configs/dpsat-table2.yaml}"
algos="${2:-}"; epsilons="${3:-}"; seeds="${4:-}"
out="${OUT:-results/gpu}"
mkdir -p "$out"
py=.venv/bin/python; [ -x "$py" ] || py=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A copy of the config restricted to the requested cells (same results_dir: finished cells are
# reused by later calls, and the reference table shows "not run" for the rest).
sub="$out/table2-config.yaml"
"$py" - "$config" "$sub" "$algos" "$epsilons" "$seeds" <<'PY'
import sys, yaml
src, dst, algos, eps, seeds = sys.argv[1:]
cfg = yaml.safe_load(open(src))
ft = cfg["finetune"]
if algos:
    ft["algorithms"] = algos.split()
if eps:
    ft["epsilons"] = [float(e) if "." in e else int(e) for e in eps.split()]
if seeds:
    ft["seeds"] = [int(s) for s in seeds.split()]
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PY
t0=$(date +%s)
"$py" -m snakemake --cores 1 --configfile "$sub" --rerun-incomplete 2>&1 | tail -n 30
echo "total wall time: $(( $(date +%s) - t0 )) s"
results=$("$py" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['results_dir'])" "$sub")
cp "$results/summary/reference.md" "$out/" && cat "$results/summary/reference.md"
"$py" - "$results" <<'PY' | tee "$out/table2_wall_times.md"
import json, sys
from pathlib import Path
print("| algorithm | epsilon | seed | test acc % | epsilon spent | wall s | device |")
print("|---|---|---|---|---|---|---|")
for p in sorted(Path(sys.argv[1], "finetune").rglob("metrics.json")):
    m = json.loads(p.read_text()); w = m["wildcards"]
    print(f"| {w['algo']} | {w['eps']} | {w['seed']} | {100 * m['test_accuracy']:.2f} | "
          f"{m['privacy']['epsilon']:.3f} | {m['wall_time_s']} | "
          f"{m.get('device', {}).get('device_name', '?')} |")
PY
