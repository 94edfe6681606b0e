"""Figures of the main run and of the sweeps, each written beside the CSV it is drawn from."""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

from dpadapter.ground import plots
from dpadapter.ground.tables import public_absence
from dpadapter.upstream.variants import parse_variant


def _write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _absent(paths: list[Path]) -> dict[str, str]:
    """Upstreams with no public accuracy to place (external weights), and why."""
    out = {}
    for p in paths:
        m = json.loads(Path(p).read_text())
        why = public_absence(m)
        if why is not None:
            out[m["wildcards"]["upstream"]] = why
    return out


def _pretrain_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for p in paths:
        m = json.loads(Path(p).read_text())
        if public_absence(m) is not None:
            continue  # external weights report no public accuracy (stages/pretrain.py)
        name = m["wildcards"]["upstream"]
        method, overrides = parse_variant(name)
        gamma = overrides.get("gamma", m.get("hyperparameters", {}).get("gamma"))
        rows.append(
            {
                "upstream": name,
                "method": method,
                "gamma": "" if gamma is None or method in ("scratch", "standard") else gamma,
                "public_test_accuracy": m["public_test_accuracy"],
                "public_test_robust_accuracy": m["public_test_robust_accuracy"],
            }
        )
    return rows


def main_figures(
    finetune_csv: Path, pretrain_paths: list[Path], upstream_order: list[str], out_dir: Path
) -> list[Path]:
    """Downstream accuracy against epsilon (a figure per algorithm) and Fig. 6 of the upstreams."""
    rows = list(csv.DictReader(open(finetune_csv)))
    written = []
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        sub = [r for r in rows if r["algorithm"] == algo]
        _write_csv(sub, out_dir / f"accuracy_vs_epsilon_{algo}.csv")
        written.append(
            plots.accuracy_vs_epsilon(
                sub,
                out_dir / f"accuracy_vs_epsilon_{algo}.png",
                algorithm=algo,
                upstream_order=upstream_order,
            )
        )
    pre, absent = _pretrain_rows(pretrain_paths), _absent(pretrain_paths)
    # every upstream has a row; one with nothing measured says why in `note`
    gaps = [{"upstream": u, "public_test_accuracy": "", "note": why} for u, why in absent.items()]
    _write_csv(pre + gaps, out_dir / "robustness_vs_accuracy.csv")
    written.append(
        plots.robustness_vs_accuracy(
            pre,
            out_dir / "robustness_vs_accuracy.png",
            upstream_order=upstream_order,
            method_key="upstream",
            absent=absent,
        )
    )
    return written


def sweep_figures(pretrain_paths: list[Path], finetune_paths: list[Path], out_dir: Path) -> None:
    """Fig. 5 (gamma sweep of DPAdapter) and Fig. 6 (SAM vs DPAdapter over gamma, + standard)."""
    pre = _pretrain_rows(pretrain_paths)
    _write_csv(pre, out_dir / "sam_vs_dpadapter.csv")
    plots.robustness_vs_accuracy(
        pre,
        out_dir / "sam_vs_dpadapter.png",
        upstream_order=["standard", "sam", "dpadapter"],
        method_key="method",
    )
    by_up = {r["upstream"]: r for r in pre}
    accs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for p in finetune_paths:
        m = json.loads(Path(p).read_text())
        w = m["wildcards"]
        accs[(w["upstream"], w["task"])].append(m["test_accuracy"])
    rows = []
    for (up, task), vals in sorted(accs.items()):
        u = by_up[up]
        if u["method"] != "dpadapter":
            continue
        rows.append(
            {
                "gamma": u["gamma"],
                "task": task,
                "public_test_accuracy": u["public_test_accuracy"],
                "public_test_robust_accuracy": u["public_test_robust_accuracy"],
                "mean_accuracy": statistics.fmean(vals),
                "std_accuracy": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                "n_seeds": len(vals),
            }
        )
    rows.sort(key=lambda r: (float(r["gamma"]), r["task"]))
    _write_csv(rows, out_dir / "gamma_sweep.csv")
    plots.gamma_sweep(rows, out_dir / "gamma_sweep.png")
