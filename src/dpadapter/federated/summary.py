"""Aggregation of the federated grid: federated.csv, the T1 rule's hit rate, and the figures.

A cell is (upstream, mechanism, epsilon, rounds). Its empirical winner is whichever of HT and
FT has the higher mean test accuracy over seeds (the rule chooses between exactly these two:
T1 = T or T1 = 0); `within_noise` flags cells where the gap is at most the larger of the two
standard deviations. The rule's prediction comes from the cell's `ut` jobs with
`ut_t1: rule` (one per seed; each seed estimates the constants with its own noise): the
majority, or "split" on a tie. The hit rate counts a cell as a hit when the majority
prediction equals the winner; the per-job rate counts every seed's prediction.
Test accuracy selects nothing here: it is reported after every run has finished.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from dpadapter.ground.tables import write_csv

COLUMNS = [
    "strategy",
    "mechanism",
    "epsilon",
    "rounds",
    "mean_accuracy",
    "std_accuracy",
    "n_seeds",
    "predicted_best",
    "upstream",
    "max_epsilon_spent",
]


def collect(paths: list[Path]) -> tuple[list[dict], dict[tuple, list[str]]]:
    """Rows (one per upstream x strategy x mechanism x epsilon x rounds) and the rule's
    per-seed predictions keyed by (upstream, mechanism, epsilon, rounds)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    preds: dict[tuple, list[str]] = defaultdict(list)
    for p in paths:
        m = json.loads(Path(p).read_text())
        w = m["wildcards"]
        key = (w["upstream"], w["strategy"], w["mechanism"], float(w["eps"]), int(w["rounds"]))
        groups[key].append(m)
        if m.get("predicted_best"):
            preds[(key[0], key[2], key[3], key[4])].append(m["predicted_best"])
    pretrained = sorted({k[0] for k in groups if k[1] != "scratch"})
    rows = []
    for (up, strat, mech, eps, rounds), ms in sorted(groups.items(), key=_order):
        accs = [m["test_accuracy"] for m in ms]
        cell_up = up if strat != "scratch" else (pretrained[0] if len(pretrained) == 1 else None)
        rows.append(
            {
                "strategy": strat,
                "mechanism": mech,
                "epsilon": eps,
                "rounds": rounds,
                "mean_accuracy": statistics.fmean(accs),
                "std_accuracy": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "n_seeds": len(accs),
                "predicted_best": _majority(preds.get((cell_up, mech, eps, rounds), [])),
                "upstream": up,
                "max_epsilon_spent": max(m["privacy"]["epsilon"] for m in ms),
            }
        )
    return rows, dict(preds)


_STRATEGY_ORDER = {"scratch": 0, "ht": 1, "ft": 2, "ut": 3, "bitfit": 4}


def _order(item):
    (up, strat, mech, eps, rounds), _ = item
    return (mech, rounds, eps, up if strat != "scratch" else "", _STRATEGY_ORDER.get(strat, 9))


def _majority(votes: list[str]) -> str:
    if not votes:
        return ""
    counts = Counter(votes).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return "split"
    return counts[0][0]


def rule_assumptions(paths: list[Path]) -> dict[tuple, list[bool]]:
    """Per cell (upstream, mechanism, epsilon, rounds): whether each rule job's step-size
    assumption of Theorems 2-3 (lr < 1/(2L), L estimated) held."""
    out: dict[tuple, list[bool]] = defaultdict(list)
    for p in paths:
        m = json.loads(Path(p).read_text())
        rule = m.get("rule")
        if rule:
            w = m["wildcards"]
            key = (w["upstream"], w["mechanism"], float(w["eps"]), int(w["rounds"]))
            out[key].append(bool(rule["step_size_condition"]))
    return dict(out)


def baselines(cells: list[dict], level: float = 0.95) -> dict:
    """The rule's cell hit rate with a Wilson interval, against always-HT, always-FT and a coin.

    always-HT hits the cells HT won; always-FT those FT won; a fair coin hits each cell with
    probability 1/2 whatever the winner. 'better' means the rule's Wilson interval lies above
    the baseline's rate (a one-sided reading of a two-sided 95 % interval).
    """
    from dpadapter.ground.stats import binomial_interval

    n = len(cells)
    if not n:
        return {}
    hits = sum(c["hit"] for c in cells)
    ci = binomial_interval(hits, n, level, "wilson")
    ht = sum(c["winner"] == "ht" for c in cells) / n
    out = {
        "hit_rate_interval": ci.as_dict(),
        "always_ht": ht,
        "always_ft": 1 - ht,
        "coin": 0.5,
    }
    for k in ("always_ht", "always_ft", "coin"):
        out[f"better_than_{k}"] = bool(ci.low > out[k])
    return out


def rule_report(
    rows: list[dict],
    preds: dict[tuple, list[str]],
    assumptions: dict[tuple, list[bool]] | None = None,
) -> dict:
    """How often the rule's prediction matched the empirical HT-vs-FT winner."""
    by_cell: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_cell[(r["upstream"], r["mechanism"], r["epsilon"], r["rounds"])][r["strategy"]] = r
    cells = []
    for key, votes in sorted(preds.items()):
        strat = by_cell.get(key, {})
        if "ht" not in strat or "ft" not in strat:
            continue
        ht, ft = strat["ht"], strat["ft"]
        winner = "ht" if ht["mean_accuracy"] > ft["mean_accuracy"] else "ft"
        gap = abs(ht["mean_accuracy"] - ft["mean_accuracy"])
        everyone = dict(strat)
        scratch = [
            r
            for r in rows
            if r["strategy"] == "scratch"
            and r["mechanism"] == key[1]
            and r["epsilon"] == key[2]
            and r["rounds"] == key[3]
        ]
        if scratch:
            everyone["scratch"] = scratch[0]
        predicted = _majority(votes)
        cells.append(
            {
                "upstream": key[0],
                "mechanism": key[1],
                "epsilon": key[2],
                "rounds": key[3],
                "predicted": predicted,
                "votes": dict(Counter(votes)),
                "winner": winner,
                "hit": predicted == winner,
                "accuracy_ht": ht["mean_accuracy"],
                "accuracy_ft": ft["mean_accuracy"],
                "within_noise": gap <= max(ht["std_accuracy"], ft["std_accuracy"]),
                "best_overall": max(everyone, key=lambda s: everyone[s]["mean_accuracy"]),
                "n_seeds_rule": len(votes),
                "n_seeds_ht": ht["n_seeds"],
                "n_seeds_ft": ft["n_seeds"],
                **(
                    {"step_size_holds": (assumptions or {}).get(key, [])}
                    if assumptions is not None
                    else {}
                ),
            }
        )
    n = len(cells)
    jobs = [(v, c["winner"]) for c in cells for v, k in c["votes"].items() for _ in range(k)]
    clear = [c for c in cells if not c["within_noise"]]
    return {
        "definition": "winner = argmax over {ht, ft} of the mean test accuracy over seeds; "
        "prediction = majority of the ut (ut_t1: rule) jobs' predicted_best",
        "cells": cells,
        "n_cells": n,
        "hits": sum(c["hit"] for c in cells),
        "hit_rate": (sum(c["hit"] for c in cells) / n) if n else None,
        "split_cells": sum(c["predicted"] == "split" for c in cells),
        "per_job_hit_rate": (sum(v == w for v, w in jobs) / len(jobs)) if jobs else None,
        "n_cells_beyond_noise": len(clear),
        "hit_rate_beyond_noise": (sum(c["hit"] for c in clear) / len(clear)) if clear else None,
        **baselines(cells),
        **(_assumption_summary(cells) if assumptions is not None else {}),
    }


def _assumption_summary(cells: list[dict]) -> dict:
    """Cells whose rule jobs all met the step-size assumption, and the hit rate on them."""
    from dpadapter.ground.stats import binomial_interval

    ok = [c for c in cells if c["step_size_holds"] and all(c["step_size_holds"])]
    jobs = [v for c in cells for v in c["step_size_holds"]]
    out = {
        "step_size_jobs_holding": sum(jobs),
        "step_size_jobs": len(jobs),
        "n_cells_step_size_holds": len(ok),
        "step_size_note": "Theorems 2-3 assume lr < 1/(2L); in a cell where any rule job's "
        "estimated L violates it, the rule is used outside its theorem",
    }
    if ok:
        hits = sum(c["hit"] for c in ok)
        out["hit_rate_step_size_holds"] = binomial_interval(hits, len(ok)).as_dict()
    return out


STRATEGY_LABELS = {
    "scratch": "scratch",
    "ht": "HT (head)",
    "ft": "FT (full)",
    "ut": "UT (rule)",
    "bitfit": "BiTFiT (biases + head)",
}


def markdown(rows: list[dict], report: dict) -> str:
    """federated.md: one table per (mechanism, rounds), rows upstream x strategy, columns ε."""
    from dpadapter.ground.tables import Stat, flagged_cells, how_to_read

    cells = flagged_cells(
        ((r["mechanism"], r["rounds"], r["upstream"], r["strategy"]), r["epsilon"],
         Stat(r["mean_accuracy"], r["std_accuracy"], r["n_seeds"]))
        for r in rows
    )  # fmt: skip
    lines = [
        "# DP federated fine-tuning: test accuracy (%), mean ± std over seeds",
        "",
        "ε: the largest ε any client spent, an upper bound from that client's accountant over "
        "every round it took part in (docs/federated.md).",
    ]
    for mech, rounds in sorted({(r["mechanism"], r["rounds"]) for r in rows}):
        part = [r for r in rows if (r["mechanism"], r["rounds"]) == (mech, rounds)]
        epss = sorted({r["epsilon"] for r in part})
        keys = list(dict.fromkeys((r["upstream"], r["strategy"]) for r in part))
        lines += [
            "",
            f"## {mech} mechanism, T = {rounds} rounds",
            "",
            "| Upstream | Strategy | " + " | ".join(f"ε={e:g}" for e in epss) + " |",
            "|---|---|" + "---|" * len(epss),
        ]
        for up, strat in keys:
            row = [cells.get(((mech, rounds, up, strat), e), "–") for e in epss]
            label = STRATEGY_LABELS.get(strat, strat)
            lines.append(f"| {up} | {label} | " + " | ".join(row) + " |")
    lines += ["", how_to_read()]
    if report.get("n_cells"):
        lines += [
            "",
            f"T1 rule (UT's choice between HT and FT): {report['hits']}/{report['n_cells']} cells "
            f"predicted the winner; {report['n_cells'] - report['n_cells_beyond_noise']} of the "
            "cells have an HT-FT gap within the larger std of the two (their winner is noise).",
        ]
    return "\n".join(lines) + "\n"


def run(
    cfg,
    metrics: list[Path],
    csv_path: Path,
    rule_path: Path,
    fig_eps: Path,
    fig_rounds: Path,
    md_path: Path,
) -> dict:
    from dpadapter.federated import plots
    from dpadapter.train.job import write_json

    rows, preds = collect(metrics)
    write_csv(rows, csv_path, COLUMNS)
    report = rule_report(rows, preds, rule_assumptions(metrics))
    write_json(rule_path, report)
    md_path.write_text(markdown(rows, report))
    fed = cfg.federated
    title = f"{cfg.model.name}, {fed.clients} clients, Dirichlet alpha={fed.dirichlet_alpha:g}"
    plots.accuracy_vs_epsilon(rows, fig_eps, rounds=fed.rounds, title=title)
    plots.accuracy_vs_rounds(rows, fig_rounds, epsilons=fed.sweep_epsilons, title=title)
    if report["n_cells"]:
        ci = report["hit_rate_interval"]
        print(
            f"T1 rule: {report['hits']}/{report['n_cells']} cells predicted the HT/FT winner "
            f"({report['split_cells']} split); hit rate {ci['estimate']:.2f} "
            f"[{ci['low']:.2f}, {ci['high']:.2f}] (95% Wilson) vs always-HT "
            f"{report['always_ht']:.2f}, always-FT {report['always_ft']:.2f}, coin 0.50; "
            f"step size lr < 1/(2L) held in {report['step_size_jobs_holding']}/"
            f"{report['step_size_jobs']} rule jobs"
        )
    return report
