"""Summaries over seeds: `finetune.csv` and a Table-1-style markdown table."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from dpadapter.tables import (
    NOT_MEASURED,
    Stat,
    absence_note,
    cell,
    flagged_cells,
    how_to_read,
    public_absence,
    write_csv,
)

COLUMNS = [
    "upstream",
    "task",
    "algorithm",
    "epsilon",
    "mean_accuracy",
    "std_accuracy",
    "n_seeds",
    "mean_robust_accuracy",
    "mean_epsilon_spent",
    "std_robust_accuracy",
]


def collect(paths: list[Path]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for p in paths:
        m = json.loads(Path(p).read_text())
        w = m["wildcards"]
        groups[(w["upstream"], w["task"], w["algo"], float(w["eps"]))].append(m)
    rows = []
    for (up, task, algo, eps), ms in sorted(groups.items()):
        acc = Stat.of([m["test_accuracy"] for m in ms])
        robust = Stat.of([m["test_robust_accuracy"] for m in ms])
        rows.append(
            {
                "upstream": up,
                "task": task,
                "algorithm": algo,
                "epsilon": eps,
                "mean_accuracy": acc.mean,
                "std_accuracy": acc.std,
                "n_seeds": acc.n,
                "mean_robust_accuracy": robust.mean,
                "mean_epsilon_spent": statistics.fmean(m["privacy"]["epsilon"] for m in ms),
                "std_robust_accuracy": robust.std,
            }
        )
    return rows


def _cells(rows: list[dict], mean: str, std: str) -> dict[tuple, str]:
    """Flagged cells keyed by (algorithm, upstream, task, epsilon), rows of one (a, u, t)."""
    return {
        (*key, eps): text
        for (key, eps), text in flagged_cells(
            ((r["algorithm"], r["upstream"], r["task"]), r["epsilon"],
             Stat(r[mean], r[std], r["n_seeds"]))
            for r in rows
        ).items()
    }  # fmt: skip


def table1_markdown(
    rows: list[dict], upstream_order: list[str], pretrain: dict[str, dict] | None = None
) -> str:
    """Rows algorithm x upstream, columns task x epsilon plus the average over tasks."""
    tasks = sorted({r["task"] for r in rows})
    epss = sorted({r["epsilon"] for r in rows})
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    present = list(dict.fromkeys(r["upstream"] for r in rows))
    ups = [u for u in upstream_order if u in present] + [
        u for u in present if u not in upstream_order
    ]
    by = {(r["algorithm"], r["upstream"], r["task"], r["epsilon"]): r for r in rows}
    acc = _cells(rows, "mean_accuracy", "std_accuracy")
    head = (
        ["Algorithm", "Upstream"]
        + [f"{t} ε={e:g}" for t in tasks for e in epss]
        + [f"Average ε={e:g}" for e in epss]
    )
    if pretrain:
        head += ["public acc", "public robust acc"]
    absent: dict[str, str] = {}
    lines = [
        "Test accuracy (%) of DP fine-tuning, mean ± std over seeds (n = seeds); Average: the "
        "mean of the task means.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for a in algos:
        for u in ups:
            if not any((a, u, t, e) in by for t in tasks for e in epss):
                continue  # an algorithm run on some upstream methods only (extra grids)
            cells = []
            for t in tasks:
                for e in epss:
                    cells.append(acc.get((a, u, t, e), "–"))
            for e in epss:
                vals = [by[(a, u, t, e)]["mean_accuracy"] for t in tasks if (a, u, t, e) in by]
                cells.append(
                    f"{100 * statistics.fmean(vals):.1f}" if len(vals) == len(tasks) else "–"
                )
            if pretrain:
                # one pre-training run per upstream method; none measured for external weights
                p = pretrain.get(u)
                if p is None:
                    cells += ["–", "–"]
                elif public_absence(p) is not None:
                    absent[u] = public_absence(p)
                    cells += [NOT_MEASURED, NOT_MEASURED]
                else:
                    cells += [
                        cell(Stat(p["public_test_accuracy"], 0.0, 1)),
                        cell(Stat(p["public_test_robust_accuracy"], 0.0, 1)),
                    ]
            lines.append(f"| {a} | {u} | " + " | ".join(cells) + " |")
    if absent:
        lines += ["", absence_note(absent)]
    lines += ["", how_to_read(), ""]
    rob = sorted(
        {(r["algorithm"], r["upstream"]) for r in rows},
        key=lambda k: (algos.index(k[0]), ups.index(k[1])),
    )
    robust = _cells(rows, "mean_robust_accuracy", "std_robust_accuracy")
    lines += [
        "Robust test accuracy (%) of the fine-tuned models (Gaussian noise on all weights), "
        "mean ± std over seeds, marked as above:",
        "",
    ]
    lines.append(
        "| "
        + " | ".join(["Algorithm", "Upstream"] + [f"{t} ε={e:g}" for t in tasks for e in epss])
        + " |"
    )
    lines.append("|" + "---|" * (2 + len(tasks) * len(epss)))
    for a, u in rob:
        cells = [robust.get((a, u, t, e), "–") for t in tasks for e in epss]
        lines.append(f"| {a} | {u} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(
    metrics_paths: list[Path],
    pretrain_paths: list[Path],
    upstream_order: list[str],
    csv_out: Path,
    md_out: Path,
) -> list[dict]:
    rows = collect(metrics_paths)
    write_csv(rows, csv_out, COLUMNS)
    pre = {}
    for p in pretrain_paths:
        m = json.loads(Path(p).read_text())
        pre[m["wildcards"]["upstream"]] = m
    md_out.write_text(table1_markdown(rows, upstream_order, pre))
    return rows
