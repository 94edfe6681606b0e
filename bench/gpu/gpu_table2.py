"""One cell of a paper's table per call, through the stage entry points, without Snakemake.

A GPU node may lack Snakemake and MLflow (the lent image has neither); this runs exactly the
jobs the `pretrain` and `finetune` rules run (`python -m dpadapter ... pretrain|finetune`, same
output folders under the config's results_dir, so Snakemake later reuses them), then the
`aggregate` and `reference` stages over every finished cell, and prints the cell beside the
paper's number with its wall time, seconds per step and peak GPU memory. A finished cell is not
run again (its metrics.json is reused); nothing finished is deleted.

    source bench/gpu/gpu_env.sh && "$py" bench/gpu/gpu_table2.py \\
        --config configs/dpsat-table2.yaml --algo dpsgd --eps 1 [--seed 0] [--out $OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from dpadapter.validation.compose import ConfigError, load


def stage_command(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "dpadapter", "--config", str(config), *args]


def stage(config: Path, *args: str) -> None:
    """One stage as its own process, as the Snakemake rule runs it."""
    cmd = stage_command(config, *args)
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def pretrain_args(cfg, upstream: str) -> tuple[Path, list[str]]:
    """The pre-trained checkpoint's path and the stage arguments that make it."""
    ckpt = Path(cfg.results_dir) / "pretrain" / upstream / "model.pt"
    return ckpt, ["pretrain", "--method", upstream, "--out", str(ckpt.parent)]


def cell_args(
    cfg, upstream: str, task: str, algo: str, eps: float, seed: int
) -> tuple[Path, list[str]]:
    """A cell's own folder (nothing else writes there) and the finetune stage's arguments."""
    results = Path(cfg.results_dir)
    cell = results / "finetune" / upstream / task / algo / f"eps{eps:g}" / f"seed{seed}"
    ckpt = results / "pretrain" / upstream / "model.pt"
    args = [
        *("finetune", "--upstream", upstream, "--task", task, "--algo", algo),
        *("--eps", f"{eps:g}", "--seed", str(seed), "--ckpt", str(ckpt), "--out", str(cell)),
    ]
    return cell, args


def summarize(config: Path, cfg, upstream: str) -> tuple[list[Path], str]:
    """`aggregate` and `reference` over every finished cell, once; the per-cell table."""
    results = Path(cfg.results_dir)
    ckpt = results / "pretrain" / upstream / "model.pt"
    done = sorted((results / "finetune").rglob("metrics.json"))
    summary = results / "summary"
    stage(
        config,
        "aggregate",
        *("--metrics", *map(str, done)),
        *("--pretrain", str(ckpt.parent / "metrics.json")),
        *("--csv", str(summary / "finetune.csv"), "--md", str(summary / "finetune.md")),
    )
    tables = [summary / "finetune.md"]
    if cfg.reference is not None:
        stage(
            config,
            "reference",
            *("--finetune-csv", str(summary / "finetune.csv")),
            *("--csv", str(summary / "reference.csv"), "--md", str(summary / "reference.md")),
        )
        tables.append(summary / "reference.md")
    lines = [HEADER]
    for p in done:
        m = json.loads(p.read_text())
        w = m["wildcards"]
        lines.append(cell_line(m, paper_cell(cfg, w["algo"], float(w["eps"]))))
    cells = "\n".join(lines) + "\n"
    (summary / "table2_cells.md").write_text(cells)
    tables.append(summary / "table2_cells.md")
    return tables, cells


def paper_cell(cfg, algo: str, eps: float):
    ref = cfg.reference
    if ref is None:
        return None
    return next(
        (c for c in ref.cells if c.algorithm == algo and float(c.epsilon) == float(eps)), None
    )


def cell_line(m: dict, paper) -> str:
    steps = m["privacy"]["steps"]
    wall = m["wall_time_s"]
    mem = m["device"].get("peak_memory_mib")
    ours = 100 * m["test_accuracy"]
    beside = "paper: none" if paper is None else f"paper {paper.mean:.2f} ± {paper.std:.2f}"
    return (
        f"| {m['wildcards']['algo']} | {m['wildcards']['eps']} | {m['wildcards']['seed']} | "
        f"{ours:.2f} | {beside} | {m['privacy']['epsilon']:.3f} | {steps} | {wall:.0f} | "
        f"{wall / steps:.3f} | {'–' if mem is None else f'{mem:.0f}'} | "
        f"{m['device'].get('device_name', m['device'].get('device'))} |"
    )


HEADER = (
    "| algorithm | ε | seed | test acc % | paper mean ± std | ε spent | steps | wall s | "
    "s/step | peak GPU MiB | device |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/dpsat-table2.yaml"))
    ap.add_argument("--algo", required=True)
    ap.add_argument("--eps", required=True, type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="copy the tables here too")
    args = ap.parse_args()
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ref = cfg.reference
    upstream = ref.upstream if ref else cfg.finetune_grid()[0][0]
    task = ref.task if ref else next(iter(cfg.tasks))
    if upstream != "scratch":
        print(f"error: {upstream!r} needs the warm-up; run the Snakemake workflow", file=sys.stderr)
        return 2
    if args.algo not in cfg.finetune.algorithms or args.eps not in cfg.finetune.epsilons:
        print(
            f"error: {args.algo} at ε = {args.eps:g} is not in the config's grid "
            f"({cfg.finetune.algorithms} x {cfg.finetune.epsilons})",
            file=sys.stderr,
        )
        return 2
    ckpt, make = pretrain_args(cfg, upstream)
    if not ckpt.is_file():
        stage(args.config, *make)
    cell, run = cell_args(cfg, upstream, task, args.algo, args.eps, args.seed)
    if (cell / "metrics.json").is_file():
        print(f"{cell}/metrics.json exists: reusing the finished cell")
    else:
        stage(args.config, *run)
    tables, cells = summarize(args.config, cfg, upstream)
    print(cells)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for t in tables:
            shutil.copy(t, args.out / t.name)
        # the cell's own record: a lent machine is bare at its next start
        shutil.copy(
            cell / "metrics.json", args.out / f"{args.algo}_eps{args.eps:g}_seed{args.seed}.json"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
