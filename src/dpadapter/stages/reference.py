"""A published table beside ours: the paper's mean ± std per cell, ours over seeds, and ERR.

Reproducing a paper means showing its numbers next to ours in the same layout. The cells come
from the config's `reference` section (the paper's numbers, typed in once with their source);
ours come from `finetune.csv` (mean and std over the seeds that ran). ERR is the DP-SAT paper's
error-rate reduction of `improved` over `baseline` at each epsilon,
(err_baseline - err_improved) / err_baseline with err = 100 - accuracy %, computed the same way
for the paper's numbers and for ours. A cell that did not run is shown as "not run", never
dropped, so a partial reproduction says what is missing. A table over several models or
datasets (DP-SAT Table 3) gives each cell its own upstream and task; it is shown as one block
per (upstream, task), in the order the cells first name them.
"""

from __future__ import annotations

import csv
from pathlib import Path

from dpadapter.ground.tables import write_csv
from dpadapter.settings import ReferenceCell, ReferenceConfig

COLUMNS = [
    "upstream",
    "task",
    "algorithm",
    "epsilon",
    "paper_mean",
    "paper_std",
    "ours_mean",
    "ours_std",
    "n_seeds",
    "difference",
]


def err(baseline: float | None, improved: float | None) -> float | None:
    """Error-rate reduction in % (accuracies in %)."""
    if baseline is None or improved is None or baseline >= 100:
        return None
    return 100 * ((100 - baseline) - (100 - improved)) / (100 - baseline)


def _where(c: ReferenceCell, ref: ReferenceConfig) -> tuple[str, str]:
    return c.upstream or ref.upstream, c.task or ref.task


def compare(rows: list[dict], ref: ReferenceConfig) -> list[dict]:
    ours = {(r["upstream"], r["task"], r["algorithm"], float(r["epsilon"])): r for r in rows}
    table = []
    for c in ref.cells:
        upstream, task = _where(c, ref)
        mine = ours.get((upstream, task, c.algorithm, float(c.epsilon)))
        mean = 100 * float(mine["mean_accuracy"]) if mine else None
        table.append(
            {
                "upstream": upstream,
                "task": task,
                "algorithm": c.algorithm,
                "epsilon": float(c.epsilon),
                "paper_mean": c.mean,
                "paper_std": c.std,
                "ours_mean": mean,
                "ours_std": 100 * float(mine["std_accuracy"]) if mine else None,
                "n_seeds": int(mine["n_seeds"]) if mine else 0,
                "difference": None if mean is None else mean - c.mean,
            }
        )
    return table


def _pm(
    mean: float | None,
    std: float | None,
    n: int | None = None,
    missing: str | None = None,
    planned: int | None = None,
) -> str:
    """`missing`: what to say of a cell without a result (the table so far: cut or not run
    yet); `planned`: the seeds the grid plans, said where fewer have finished."""
    if mean is None:
        return missing or "not run"
    s = f"{mean:.2f} ± {std:.2f}"
    if n is not None and planned is not None and n < planned:
        return s + f" ({n} of {planned} seeds)"
    return s + (f" ({n} seed{'s' if n != 1 else ''})" if n is not None else "")


def markdown(table: list[dict], ref: ReferenceConfig, title: str | None = None) -> str:
    """Rows of `compare`; a row may add `status` (shown where ours is missing) and `n_planned`
    (the seeds planned), as the table so far does (stages.table_so_far)."""
    blocks = list(dict.fromkeys((r["upstream"], r["task"]) for r in table))
    algos = list(dict.fromkeys(r["algorithm"] for r in table))
    lines = [f"# {title or ref.name}", ""]
    if len(blocks) == 1:
        upstream, task = blocks[0]
        lines += [
            f"Source: {ref.source}. Ours: `{upstream}` → `{task}`, test accuracy % "
            "(mean ± std over seeds). ERR: error-rate reduction of "
            f"{ref.improved} over {ref.baseline}.",
            "",
        ]
    else:
        lines += [
            f"Source: {ref.source}. Ours: test accuracy % (mean ± std over seeds), one table "
            f"per upstream and task. ERR: error-rate reduction of {ref.improved} over "
            f"{ref.baseline}.",
            "",
        ]
    for upstream, task in blocks:
        if len(blocks) > 1:
            lines += [f"## `{upstream}` → `{task}`", ""]
        rows = [r for r in table if (r["upstream"], r["task"]) == (upstream, task)]
        lines += _block(rows, algos, ref)
        lines.append("")
    if ref.notes:
        lines.append(ref.notes)
    return "\n".join(lines).rstrip("\n") + "\n"


def _block(rows: list[dict], algos: list[str], ref: ReferenceConfig) -> list[str]:
    epsilons = sorted({r["epsilon"] for r in rows})
    cell = {(r["algorithm"], r["epsilon"]): r for r in rows}
    lines = [
        "| ε | "
        + " | ".join(f"{a} (paper) | {a} (ours)" for a in algos)
        + " | ERR paper | ERR ours |",
        "|---|" + "---|---|" * len(algos) + "---|---|",
    ]
    for e in epsilons:
        parts = []
        for a in algos:
            r = cell.get((a, e))
            parts.append(_pm(r["paper_mean"], r["paper_std"]) if r else "–")
            ours = r and (r["ours_mean"], r["ours_std"], r["n_seeds"], r.get("status"))
            parts.append(_pm(*ours, r.get("n_planned")) if r else "–")
        b, i = cell.get((ref.baseline, e)), cell.get((ref.improved, e))
        e_paper = err(b and b["paper_mean"], i and i["paper_mean"])
        e_ours = err(b and b["ours_mean"], i and i["ours_mean"])
        fmt = lambda v: "–" if v is None else f"{v:.2f}%"  # noqa: E731
        lines.append(f"| {e:g} | " + " | ".join(parts) + f" | {fmt(e_paper)} | {fmt(e_ours)} |")
    return lines


def run(finetune_csv: Path, ref: ReferenceConfig, out_csv: Path, out_md: Path) -> list[dict]:
    with open(finetune_csv, newline="") as fh:
        rows = list(csv.DictReader(fh))
    table = compare(rows, ref)
    write_csv(table, out_csv, COLUMNS)
    out_md.write_text(markdown(table, ref))
    return table
