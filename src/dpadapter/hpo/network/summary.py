"""`results/summary/hpo.{csv,md}`: linear scaling vs. random search vs. the grid oracle.

One row per (upstream, task, algorithm, method), averaged over HPO seeds. `total_epsilon` is
everything spent (trials and selections included; for the oracle, every grid run, although its
tuning is not part of its claim) and is the maximum over seeds, so it bounds each replicate.
RERR = (linear - random) / (oracle - random), the relative error reduction of Table 3.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from dpadapter.ground.tables import Stat, cell, flagged_cells, how_to_read, write_csv

COLUMNS = [
    "method",
    "accuracy",
    "total_epsilon",
    "target_epsilon",
    "upstream",
    "task",
    "algorithm",
    "std_accuracy",
    "n_seeds",
    "tuning_accounted",
    "selection",
    "note",
]
METHODS = ("random_search", "grid_oracle", "linear_scaling")
LABELS = {
    "random_search": "Random search",
    "grid_oracle": "Grid oracle (HPO cost not incl.)",
    "linear_scaling": "Linear scaling (ours)",
}


def _key(d: dict) -> tuple[str, str, str]:
    return (d["upstream"], d["task"], d["algorithm"])


def _record(method: str, path: Path) -> dict:
    m = json.loads(Path(path).read_text())
    if method == "grid_oracle":
        return {
            "upstream": m["upstream"],
            "task": m["task"],
            "algorithm": m["algorithm"],
            "accuracy": m["test_accuracy"],
            "total_epsilon": m["total_epsilon"],
            "target_epsilon": m["target_epsilon"],
            "tuning_accounted": False,
            "selection": "raw validation argmax",
            "note": f"cost of tuning not accounted; one grid, training seed {m['seed']}",
        }
    w, h = m["wildcards"], m["hpo"]
    note = h.get("privacy_assumption", "")
    return {
        "upstream": w["upstream"],
        "task": w["task"],
        "algorithm": w["algo"],
        "accuracy": m["test_accuracy"],
        "total_epsilon": h["total_epsilon"],
        "target_epsilon": h["target_epsilon"],
        "tuning_accounted": h["selection_accounted"],
        "selection": h["selection"],
        "note": note,
    }


def collect(final: list[Path], random: list[Path], oracle: list[Path]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for method, paths in (
        ("random_search", random),
        ("grid_oracle", oracle),
        ("linear_scaling", final),
    ):
        for p in paths:
            r = _record(method, p)
            groups[(*_key(r), method)].append(r)
    rows = []
    for (up, task, algo, method), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][:3], METHODS.index(kv[0][3]))
    ):
        accs = [r["accuracy"] for r in rs]
        rows.append(
            {
                "method": method,
                "accuracy": statistics.fmean(accs),
                "total_epsilon": max(r["total_epsilon"] for r in rs),
                "target_epsilon": rs[0]["target_epsilon"],
                "upstream": up,
                "task": task,
                "algorithm": algo,
                "std_accuracy": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "n_seeds": len(rs),
                "tuning_accounted": all(r["tuning_accounted"] for r in rs),
                "selection": rs[0]["selection"],
                "note": rs[0]["note"],
            }
        )
    return rows


def rerr(linear: float, random: float, oracle: float) -> float:
    """(linear - random) / (oracle - random); NaN when the oracle does not beat random search."""
    gap = oracle - random
    if not gap > 0:
        return math.nan
    return (linear - random) / gap


def markdown(rows: list[dict]) -> str:
    by = {(r["upstream"], r["task"], r["algorithm"], r["method"]): r for r in rows}
    keys = sorted({(r["upstream"], r["task"], r["algorithm"]) for r in rows})
    lines = [
        "Private HPO (linear scaling rule): test accuracy (%) of the final model, mean ± std over "
        "HPO seeds; ε = everything spent (max over seeds) at the target's δ.",
        "",
        "| Upstream | Task | Algorithm | Method | Accuracy | total ε | target ε "
        "| tuning accounted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # A method's rows at several target budgets are flagged against each other.
    acc = flagged_cells(
        ((k[:3], k[3]), r["target_epsilon"], Stat(r["accuracy"], r["std_accuracy"], r["n_seeds"]))
        for k, r in by.items()
    )
    for k in keys:
        for m in METHODS:
            r = by.get((*k, m))
            if r is None:
                continue
            shown = acc[((k, m), float(r["target_epsilon"]))]
            lines.append(
                f"| {k[0]} | {k[1]} | {k[2]} | {LABELS[m]} | {shown} | {r['total_epsilon']:.3f} | "
                f"{r['target_epsilon']:g} | {'yes' if r['tuning_accounted'] else 'no'} |"
            )
    lines += [
        "",
        how_to_read("test accuracy (%) of the final model", "HPO seeds"),
        "",
        "Table 3 analogue (RERR = (linear − random) / (oracle − random), of the means):",
        "",
        "| Upstream | Task | Algorithm | Random search | Oracle | Ours | RERR (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        got = [by.get((*k, m)) for m in METHODS]
        if any(g is None for g in got):
            continue
        rs, orc, lin = (g["accuracy"] for g in got)
        e = rerr(lin, rs, orc)
        shown = " | ".join(cell(Stat(g["accuracy"], g["std_accuracy"], g["n_seeds"])) for g in got)
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {shown} | "
            f"{'n/a (oracle ≤ random)' if math.isnan(e) else f'{100 * e:.1f}'} |"
        )
    notes = sorted({r["note"] for r in rows if r["method"] == "linear_scaling" and r["note"]})
    if notes:
        lines += ["", *(f"Note: {n}." for n in notes)]
    return "\n".join(lines) + "\n"


def run(
    final: list[Path], random: list[Path], oracle: list[Path], csv_path: Path, md_path: Path
) -> list[dict]:
    rows = collect(final, random, oracle)
    write_csv(rows, csv_path, COLUMNS)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(rows))
    return rows
