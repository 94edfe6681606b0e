"""Summaries over seeds: `finetune.csv` and a Table-1-style markdown table."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from dpadapter.ground.tables import (
    NOT_MEASURED,
    Stat,
    absence_note,
    cell,
    flagged_cells,
    how_to_read,
    public_absence,
    write_csv,
)
from dpadapter.settings import join_folder

COLUMNS = [
    "upstream",
    "task",
    "algorithm",
    "strategy",
    "epsilon",
    "mean_accuracy",
    "std_accuracy",
    "n_seeds",
    "mean_robust_accuracy",
    "mean_epsilon_spent",
    "std_robust_accuracy",
]


def collect(paths: list[Path]) -> list[dict]:
    return rows_of([json.loads(Path(p).read_text()) for p in paths])


def strategy_of(m: dict) -> str:
    """The tuning strategy a job ran (`ft` for a job from before strategies were recorded)."""
    return (m.get("hyperparameters") or {}).get("strategy") or "ft"


def strategy_label(ms: list[dict]) -> str:
    """A strategy as the tables name it; `ut` with its T₁, the head-tuning share of the steps."""
    strategy = strategy_of(ms[0])
    if strategy != "ut":
        return strategy
    shares = {
        round(100 * m["hyperparameters"]["t1"] / m["privacy"]["steps"])
        for m in ms
        if m["privacy"].get("steps")
    }
    return f"ut, T₁ {'/'.join(f'{s}%' for s in sorted(shares))}" if shares else "ut"


def rows_of(metrics: list[dict]) -> list[dict]:
    """`collect` of jobs' metrics already read."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for m in metrics:
        w = m["wildcards"]
        key = (w["upstream"], w["task"], w["algo"], strategy_of(m), float(w["eps"]))
        groups[key].append(m)
    rows = []
    for (up, task, algo, strategy, eps), ms in sorted(groups.items()):
        acc = Stat.of([m["test_accuracy"] for m in ms])
        robust = Stat.of([m["test_robust_accuracy"] for m in ms])
        seeds = [int(m["wildcards"].get("seed", -1 - i)) for i, m in enumerate(ms)]
        acc_by_seed = tuple(zip(seeds, (m["test_accuracy"] for m in ms), strict=True))
        robust_by_seed = tuple(zip(seeds, (m["test_robust_accuracy"] for m in ms), strict=True))
        rows.append(
            {
                "upstream": up,
                "task": task,
                "algorithm": algo,
                "strategy": strategy,
                "_strategy_label": strategy_label(ms),
                "epsilon": eps,
                "mean_accuracy": acc.mean,
                "std_accuracy": acc.std,
                "n_seeds": acc.n,
                "mean_robust_accuracy": robust.mean,
                "mean_epsilon_spent": statistics.fmean(m["privacy"]["epsilon"] for m in ms),
                "_eps_max": max(m["privacy"]["epsilon"] for m in ms),
                "_deltas": {m["privacy"]["delta"] for m in ms if "delta" in m["privacy"]},
                "_accountants": {
                    m["privacy"]["accountant"] for m in ms if "accountant" in m["privacy"]
                },
                "std_robust_accuracy": robust.std,
                # not columns: each seed's value, so that the ε marks compare seed with seed
                "_by_seed": {
                    "mean_accuracy": acc_by_seed,
                    "mean_robust_accuracy": robust_by_seed,
                },
            }
        )
    return rows


def _key(r: dict) -> tuple[str, str]:
    """A table row's method: (algorithm, tuning strategy)."""
    return r["algorithm"], r.get("strategy", "ft")


def _cells(rows: list[dict], mean: str, std: str) -> dict[tuple, str]:
    """Flagged cells keyed by ((algorithm, strategy), upstream, task, epsilon), rows of one
    (method, upstream, task)."""
    return {
        (*key, eps): text
        for (key, eps), text in flagged_cells(
            ((_key(r), r["upstream"], r["task"]), r["epsilon"],
             Stat(r[mean], r[std], r["n_seeds"], r.get("_by_seed", {}).get(mean, ())))
            for r in rows
        ).items()
    }  # fmt: skip


def table1_markdown(
    rows: list[dict],
    upstream_order: list[str],
    pretrain: dict[str, dict] | None = None,
    algorithm_order: list[str] | None = None,
) -> str:
    """Rows algorithm (x tuning strategy) x upstream, columns task x epsilon plus the average
    over tasks. Several strategies get a Strategy column; one is named under the title.
    `algorithm_order`: the blocks' order (the config's grids, as the paper's table lists its
    algorithms); algorithms it does not name follow, in the rows' order."""
    tasks = sorted({r["task"] for r in rows})
    epss = sorted({r["epsilon"] for r in rows})
    methods = list(dict.fromkeys(_key(r) for r in rows))
    if algorithm_order:
        rank = {a: i for i, a in enumerate(algorithm_order)}
        methods.sort(key=lambda m: rank.get(m[0], len(rank)))  # stable: rows' order within
    labels = {_key(r): r.get("_strategy_label", r.get("strategy", "ft")) for r in rows}
    several = len({m[1] for m in methods}) > 1
    present = list(dict.fromkeys(r["upstream"] for r in rows))
    ups = [u for u in upstream_order if u in present] + [
        u for u in present if u not in upstream_order
    ]
    by = {(_key(r), r["upstream"], r["task"], r["epsilon"]): r for r in rows}
    acc = _cells(rows, "mean_accuracy", "std_accuracy")
    names = ["Algorithm", "Strategy", "Upstream"] if several else ["Algorithm", "Upstream"]

    def label(m: tuple[str, str], u: str) -> str:
        return " | ".join([m[0], labels[m], u] if several else [m[0], u])

    head = (
        names + [f"{t} ε={e:g}" for t in tasks for e in epss] + [f"Average ε={e:g}" for e in epss]
    )
    if pretrain:
        head += ["public acc", "public robust acc"]
    absent: dict[str, str] = {}
    tuning = ""
    if not several and methods:  # one strategy: named in the title
        only = methods[0]
        words = STRATEGY_WORDS.get(only[1])
        tuning = f", tuning strategy {labels[only]}" + (f" ({words})" if words else "")
    lines = [
        f"Test accuracy (%) of DP fine-tuning{tuning}, mean ± std over seeds (n = seeds); "
        "Average: the mean of the task means.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for m in methods:
        for u in ups:
            if not any((m, u, t, e) in by for t in tasks for e in epss):
                continue  # an algorithm run on some upstream methods only (extra grids)
            cells = []
            for t in tasks:
                for e in epss:
                    cells.append(acc.get((m, u, t, e), "–"))
            for e in epss:
                vals = [by[(m, u, t, e)]["mean_accuracy"] for t in tasks if (m, u, t, e) in by]
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
            lines.append(f"| {label(m, u)} | " + " | ".join(cells) + " |")
    if absent:
        lines += ["", absence_note(absent)]
    lines += ["", how_to_read(paired=True), ""]
    rob = sorted(
        {(_key(r), r["upstream"]) for r in rows},
        key=lambda k: (methods.index(k[0]), ups.index(k[1])),
    )
    robust = _cells(rows, "mean_robust_accuracy", "std_robust_accuracy")
    lines += [
        "Robust test accuracy (%) of the fine-tuned models (Gaussian noise on all weights), "
        "mean ± std over seeds, marked as above:",
        "",
    ]
    cols = names + [f"{t} ε={e:g}" for t in tasks for e in epss]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for m, u in rob:
        cells = [robust.get((m, u, t, e), "–") for t in tasks for e in epss]
        lines.append(f"| {label(m, u)} | " + " | ".join(cells) + " |")
    lines += privacy_spent(rows, [(m, u, label(m, u)) for m, u in rob], names, tasks, epss)
    return "\n".join(lines) + "\n"


# What each tuning strategy trains, for the title of a one-strategy table
STRATEGY_WORDS = {
    "ft": "full tuning: every weight",
    "ht": "head tuning: the classifier only",
    "ut": "unified tuning: the head only for the first T₁ of the steps, then every weight",
    "bitfit": "BiTFiT: the biases and the head",
}


# how far below its target a job's ε may end: the calibration's own tolerance on ε
# (privacy.calibration.OPACUS); a cell further below spent less than it was given
SPENT_TOLERANCE = 0.005
UNDER = "‡"


def privacy_spent(
    rows: list[dict], keys: list[tuple], names: list[str], tasks: list, epss: list
) -> list[str]:
    """ε spent per cell (the largest over its seeds, from each job's accountant), with δ and
    the accountant; a cell more than the calibration's tolerance below its target is marked.
    `keys`: (method, upstream, row label) of each row."""
    by = {(_key(r), r["upstream"], r["task"], r["epsilon"]): r for r in rows}
    deltas = sorted({d for r in rows for d in r.get("_deltas", ())})
    accountants = sorted({a for r in rows for a in r.get("_accountants", ())})
    cols = names + [f"{t} ε={e:g}" for t in tasks for e in epss]
    lines = [
        "",
        "ε spent (the largest over the seeds of a cell: each job's accountant over every step it "
        f"took), δ = {', '.join(f'{d:g}' for d in deltas) or '?'}, accountant "
        f"{', '.join(accountants) or '?'}; {UNDER} more than {SPENT_TOLERANCE} below the target "
        "(spent less than it was given):",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for m, u, label in keys:
        cells = []
        for t in tasks:
            for e in epss:
                r = by.get((m, u, t, e))
                spent = None if r is None else r.get("_eps_max", r.get("mean_epsilon_spent"))
                if spent is None:
                    cells.append("–")
                    continue
                mark = f" {UNDER}" if spent < e - SPENT_TOLERANCE else ""
                cells.append(f"{spent:.3f}{mark}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def run(
    metrics_paths: list[Path],
    pretrain_paths: list[Path],
    upstream_order: list[str],
    csv_out: Path,
    md_out: Path,
    paired_json: Path | None = None,
    algorithm_order: list[str] | None = None,
) -> list[dict]:
    """finetune.csv and finetune.md: the table, the paired differences between upstreams
    (`stages.paired`; their numbers to `paired_json`), the paper's Table 1 question answered
    per algorithm (`stages.table1`) and any unverified jobs named."""
    from dpadapter.stages import paired, table1

    metrics = [json.loads(Path(p).read_text()) for p in metrics_paths]  # read once
    rows = rows_of(metrics)
    write_csv(rows, csv_out, COLUMNS)
    pre = {}
    for p in pretrain_paths:
        m = json.loads(Path(p).read_text())
        pre[m["wildcards"]["upstream"]] = m
    result = paired.analyse(metrics)
    md_out.write_text(
        table1_markdown(rows, upstream_order, pre, algorithm_order)
        + paired.run(metrics, paired_json, result)
        + table1.markdown(result, algorithm_order)
        + unverified_note(metrics)
    )
    return rows


def unverified_note(metrics: list[dict]) -> str:
    """A caveat under the table (and so in the report) naming every job whose per-example
    clipping was not verified (`finetune.per_sample_check: false`); empty when all were."""
    jobs = []
    for m in metrics:
        if (m.get("per_sample_check") or {}).get("verified") is False:
            w = m["wildcards"]
            seed = w.get("seed", "?")
            algo = join_folder(w["algo"], w.get("strategy"))
            jobs.append(f"{w['upstream']}/{w['task']}/{algo}/eps{w['eps']}/seed{seed}")
    if not jobs:
        return ""
    return (
        f"\n**Per-example clipping unverified** in {len(jobs)} of {len(metrics)} jobs "
        "(`finetune.per_sample_check: false`: the per-sample self-test did not run, so their "
        "per-example norms and clipped sums were not compared with the reference before "
        "training; their ε assumes they are right): " + ", ".join(sorted(jobs)) + ".\n"
    )
