"""Upstreams compared as the experiment pairs them: by seed, with intervals on the differences.

Every upstream of a seed is fine-tuned with the same head, the same Poisson batches and the same
noise draws, so "does DPAdapter beat standard pre-training?" is a paired question: a seed whose
batches are unlucky is low for every upstream together (on fmnist-shift at ε = 1, seed 1 is), and
comparing cell means and stds unpaired counts that shared luck as noise. Here, for each pair the
table compares (`PAIRS`) and each algorithm:

- per cell (task, ε): the per-seed differences, their mean and a 95 % paired Student-t interval
  (`stats.paired_interval`; with 3 seeds, 2 degrees of freedom: wide);
- pooled over every cell and seed: the mean difference from an additive model with a cell
  effect and a seed effect (ordinary least squares in statsmodels, sum-to-zero coding, so the
  intercept is the mean difference over cells), with its 95 % interval. Why this model: a
  cell's difference may depend on the task and ε (DPAdapter may help more at ε = 1), and a
  seed's on its shared draws across cells; both effects are removed from the residual the
  interval is built on, which the cells' twelve differences pooled as independent would not do;
- the smallest difference the design detects with 80 % power at 5 % two-sided
  (`stats.detectable_difference`, from the fitted residual spread), and what more seeds would
  bring it to, with their cost in fine-tuning jobs.

Written by the aggregate stage (so `make run` prints it under the table, the report shows it, and
`summary/paired.json` feeds the validity page), from the jobs' metrics.json alone (read once,
by the aggregate stage).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from dpadapter.ground.stats import detectable_difference, paired_interval, pooled_paired
from dpadapter.settings import join_folder

# (upstream, the one it is compared with): the questions the default table asks
PAIRS = (
    ("dpadapter", "standard"),
    ("dpadapter", "control"),
    ("sam", "standard"),
    ("standard", "scratch"),
)
POWER, ALPHA = 0.8, 0.05
MORE_SEEDS = (5, 10)  # projected seed counts


def per_seed(metrics: list[dict]) -> dict[tuple, dict[int, float]]:
    """(upstream, task, algorithm folder, ε) -> {seed: test accuracy}."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for m in metrics:
        w = m["wildcards"]
        # a strategy besides finetune.strategy is compared within itself, named as its folder
        algo = join_folder(w["algo"], w.get("strategy"))
        key = (w["upstream"], w["task"], algo, float(w["eps"]))
        out[key][int(w.get("seed", 0))] = float(m["test_accuracy"])
    return out


def compare(acc: dict[tuple, dict[int, float]], a: str, b: str, algo: str) -> dict | None:
    """`a` − `b` for one algorithm: per cell, pooled, and the detectable difference."""
    cells = []
    for (up, task, alg, eps), seeds_a in sorted(acc.items()):
        if up != a or alg != algo or (b, task, alg, eps) not in acc:
            continue
        seeds_b = acc[(b, task, alg, eps)]
        common = sorted(seeds_a.keys() & seeds_b.keys())
        diffs = {s: seeds_a[s] - seeds_b[s] for s in common}
        if not diffs:
            continue
        ci = paired_interval(list(diffs.values()))
        cells.append({"task": task, "epsilon": eps, "diffs": diffs, "interval": ci.as_dict()})
    if not cells:
        return None
    long = [(f"{c['task']} ε={c['epsilon']:g}", s, d) for c in cells for s, d in c["diffs"].items()]
    pooled = pooled_paired(long)
    out = {"upstream": a, "versus": b, "algorithm": algo, "cells": cells, "pooled": pooled}
    if pooled is not None:
        out["detectable"] = detectable_difference(pooled["se"], pooled["df"], POWER, ALPHA)
        n_cells, n_seeds = len(cells), len({s for c in cells for s in c["diffs"]})
        resid = pooled["residual_sd"]
        out["with_more_seeds"] = {
            str(k): detectable_difference(
                resid / (n_cells * k) ** 0.5, n_cells * k - n_cells - k + 1, POWER, ALPHA
            )
            for k in MORE_SEEDS
            if k > n_seeds
        }
    return out


def analyse(metrics: list[dict]) -> dict:
    """Every comparison of `PAIRS` over these jobs' metrics (as metrics.json holds them)."""
    acc = per_seed(metrics)
    algos = sorted({k[2] for k in acc})
    seeds = sorted({s for v in acc.values() for s in v})
    walls = [m["wall_time_s"] for m in metrics if isinstance(m.get("wall_time_s"), int | float)]
    comparisons = [
        c for a, b in PAIRS for algo in algos if (c := compare(acc, a, b, algo)) is not None
    ]
    return {
        "power": POWER,
        "alpha": ALPHA,
        "seeds": seeds,
        "jobs": len(metrics),
        "job_seconds_mean": statistics.fmean(walls) if walls else None,
        "comparisons": comparisons,
    }


def _pts(v: float) -> str:
    return f"{100 * v:+.1f}"


def markdown(result: dict) -> str:
    comps = result["comparisons"]
    if not comps:
        return ""
    lines = [
        "",
        "### Paired differences (same seed: same head, batches and noise draws)",
        "",
        "Test accuracy of the first upstream minus the second, in points; per cell the mean of "
        "the per-seed differences and its 95 % paired Student-t interval; pooled: an additive "
        "model with cell and seed effects (OLS), its 95 % interval, and the smallest difference "
        f"detected with {result['power']:.0%} power at {result['alpha']:.0%} two-sided.",
        "",
        "| comparison | algorithm | " + " | ".join(_cell_names(comps)) + " | pooled | detectable |",
        "|---|---|" + "---|" * len(_cell_names(comps)) + "---|---|",
    ]
    names = _cell_names(comps)
    for c in comps:
        by_name = {f"{x['task']} ε={x['epsilon']:g}": x for x in c["cells"]}
        cells = []
        for n in names:
            x = by_name.get(n)
            if x is None:
                cells.append("–")
                continue
            ci = x["interval"]
            cells.append(
                f"{_pts(ci['estimate'])} [{_pts(ci['low'])}, {_pts(ci['high'])}]"
                if ci["n"] > 1
                else f"{_pts(ci['estimate'])} (n=1)"
            )
        p = c["pooled"]
        pooled = f"**{_pts(p['estimate'])}** [{_pts(p['low'])}, {_pts(p['high'])}]" if p else "n/a"
        det = f"±{100 * c['detectable']:.1f}" if c.get("detectable") else "n/a"
        lines.append(
            f"| {c['upstream']} − {c['versus']} | {c['algorithm']} | "
            + " | ".join(cells)
            + f" | {pooled} | {det} |"
        )
    lines += ["", power_note(result)]
    return "\n".join(lines) + "\n"


def power_note(result: dict) -> str:
    """What the seeds can detect, and what more would cost (the line under the table)."""
    main = next((c for c in result["comparisons"] if c.get("detectable")), None)
    if main is None:
        return "With one seed per cell no difference can be tested: run more seeds."
    n = len(result["seeds"])
    text = (
        f"**Power.** With {n} seeds, the pooled {main['upstream']} − {main['versus']} "
        f"({main['algorithm']}) difference is detected with {result['power']:.0%} power from "
        f"±{100 * main['detectable']:.1f} points (residual spread "
        f"{100 * main['pooled']['residual_sd']:.1f} points)"
    )
    more = main.get("with_more_seeds") or {}
    per_seed_jobs = result["jobs"] / max(n, 1)
    if more and result.get("job_seconds_mean"):
        parts = []
        for k, d in more.items():
            extra = (int(k) - n) * per_seed_jobs * result["job_seconds_mean"] / 60
            parts.append(f"{k} seeds ±{100 * d:.1f} (about {extra:.0f} more job-minutes)")
        text += "; " + ", ".join(parts)
    return text + "."


def _cell_names(comps: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for c in comps:
        for x in c["cells"]:
            seen.setdefault(f"{x['task']} ε={x['epsilon']:g}", None)
    return list(seen)


def run(metrics: list[dict], json_out: Path | None = None, result: dict | None = None) -> str:
    """The paired section (markdown) of these jobs; its numbers to `json_out` when given.
    `result`: `analyse(metrics)` when the caller has it already (it fits a model per pair)."""
    result = analyse(metrics) if result is None else result
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return markdown(result)
