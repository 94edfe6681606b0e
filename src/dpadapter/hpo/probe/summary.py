"""hpo.csv / hpo.md / hpo.json of the linear-probe regime: premise first, then RERR with spread.

RERR = (linear scaling - E[random search]) / (oracle - E[random search]) per HPO seed, at each
target budget; reported as the mean over HPO seeds with a Student-t 95 % interval
(`dpadapter.ground.stats.t_interval`). The oracle and random search come from the oracle stage
(seeds
averaged, the random search's expectation exact over the grid); they are the same for every HPO
seed, so the interval is the spread of the HPO itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dpadapter.ground.stats import t_interval
from dpadapter.ground.tables import Stat, flagged_cells, how_to_read

COLUMNS = [
    "upstream",
    "task",
    "target_epsilon",
    "method",
    "selection_accounted",
    "mean_accuracy",
    "std_accuracy",
    "n_seeds",
    "rerr_mean",
    "rerr_low",
    "rerr_high",
    "max_total_epsilon",
]
LABELS = {
    "accounted": "linear scaling, accounted selection",
    "raw": "linear scaling, paper's raw selection (NOT covered by the guarantee)",
}


def rerr_of(accuracy: float, budget: dict) -> float:
    """RERR of one run; NaN where the oracle does not beat random search (no premise to test)."""
    m = budget["margin"]
    return (accuracy - budget["random_search_expected_test"]) / m if m > 0 else float("nan")


def summarise(oracles: dict[tuple[str, str], dict], seeds: dict[tuple[str, str], list[dict]]):
    """Rows of the CSV and the structured result (`hpo.json`, read by the validity page)."""
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"cells": []}
    for (up, task), o in sorted(oracles.items()):
        runs = sorted(seeds.get((up, task), []), key=lambda s: s["seed"])
        if not runs:
            raise ValueError(f"no HPO seeds for {up}/{task}")
        cell: dict[str, Any] = {
            "upstream": up,
            "task": task,
            "premise": o["premise"],
            "seeds": [s["seed"] for s in runs],
            "targets": {},
        }
        for key, b in sorted(o["budgets"].items(), key=lambda kv: kv[1]["epsilon"]):
            eps = b["epsilon"]
            in_targets = all(key in s["selections"]["raw"]["targets"] for s in runs)
            entry: dict[str, Any] = {
                "oracle_best_r": b["best_r"],
                "oracle_test": b["oracle_test"],
                "random_search_expected_test": b["random_search_expected_test"],
                "margin": b["margin"],
            }
            if in_targets:
                best = b["grid"][b["best_index"]]["test_accuracy"]  # per oracle seed
                rows.append(_row(up, task, eps, "grid_oracle", None, best, None))
                rows.append(
                    _row(up, task, eps, "random_search", True, [b["random_search_expected_test"]])
                )
                for name in ("accounted", "raw"):
                    if name not in runs[0]["selections"]:
                        continue
                    tr = [s["selections"][name]["targets"][key] for s in runs]
                    acc = [t["test_accuracy"] for t in tr]
                    rerr = [rerr_of(a, b) for a in acc]
                    ci = t_interval(rerr)
                    totals = [t["total_epsilon"] for t in tr]
                    rows.append(
                        _row(
                            up,
                            task,
                            eps,
                            f"linear_scaling_{name}",
                            name == "accounted",
                            acc,
                            ci,
                            max(totals),
                        )  # fmt: skip
                    )
                    entry[name] = {
                        "accuracy": acc,
                        "rerr": rerr,
                        "rerr_interval": ci.as_dict(),
                        "r_star": [t["r_star"] for t in tr],
                        "final_epsilon": [t["final_epsilon"] for t in tr],
                        "max_total_epsilon": max(totals),
                        "covered_by_guarantee": name == "accounted",
                    }
            cell["targets" if in_targets else "sweep_budgets"] = {
                **cell.get("targets" if in_targets else "sweep_budgets", {}),
                f"{eps:g}": entry,
            }
        result["cells"].append(cell)
    return rows, result


def _row(up, task, eps, method, accounted, acc, ci=None, total=None) -> dict[str, Any]:
    a = np.asarray(acc, dtype=float)
    row = {
        "upstream": up,
        "task": task,
        "target_epsilon": eps,
        "method": method,
        "selection_accounted": "" if accounted is None else str(bool(accounted)).lower(),
        "mean_accuracy": float(a.mean()),
        "std_accuracy": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        "n_seeds": len(a),
    }
    if ci is not None:
        row.update(rerr_mean=ci.estimate, rerr_low=ci.low, rerr_high=ci.high)
    if total is not None:
        row["max_total_epsilon"] = total
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Private HPO: the linear scaling rule in the paper's regime (linear probe)", ""]
    for c in result["cells"]:
        p = c["premise"]
        lines += [
            f"## {c['upstream']} → {c['task']} (HPO seeds {c['seeds']})",
            "",
            "**Premise** — the oracle's best r = η·T against ε (grid oracle: every grid point at "
            "the whole budget, mean validation accuracy over its training seeds; tuning NOT "
            "accounted):",
            "",
            "| ε | oracle best r | oracle test acc | E[random search] | oracle − random |",
            "|---|---|---|---|---|",
        ]
        allb = {**c.get("sweep_budgets", {}), **c["targets"]}
        for k in sorted(allb, key=float):
            b = allb[k]
            lines.append(
                f"| {k} | {b['oracle_best_r']:.4g} | {100 * b['oracle_test']:.1f} | "
                f"{100 * b['random_search_expected_test']:.1f} | {100 * b['margin']:+.1f} |"
            )
        verdict = "holds" if p["holds"] else "does NOT hold"
        lines += [
            "",
            f"Best r rises roughly linearly with ε: **{verdict}** (least-squares slope "
            f"{p['slope']:.4g} per unit ε, R² = {p['r2']:.2f}, Spearman ρ = {p['spearman']:.2f}; "
            "'holds' needs slope > 0, ρ ≥ 0.8, R² ≥ 0.8).",
            "",
            "**RERR** = (linear scaling − E[random]) / (oracle − E[random]) per HPO seed; mean "
            "and 95 % Student-t interval over the seeds. Accuracies in % (mean ± std over seeds); "
            "every ε is a dp-accounting PLD upper bound of all trials, selections and the final "
            "run.",
            "",
            "| target ε | method | test acc | RERR [95 % CI] | max total ε | covered |",
            "|---|---|---|---|---|---|",
        ]
        acc = flagged_cells(
            (name, float(k), Stat.of(b[name]["accuracy"]))
            for k, b in c["targets"].items()
            for name in ("accounted", "raw")
            if name in b
        )
        for k in sorted(c["targets"], key=float):
            b = c["targets"][k]
            for name in ("accounted", "raw"):
                if name not in b:
                    continue
                e = b[name]
                ci = e["rerr_interval"]
                lines.append(
                    f"| {k} | {LABELS[name]} | {acc[(name, float(k))]} | "
                    f"{ci['estimate']:.2f} [{ci['low']:.2f}, {ci['high']:.2f}] | "
                    f"{e['max_total_epsilon']:.4f} | "
                    f"{'yes' if e['covered_by_guarantee'] else 'NO'} |"
                )
        lines += ["", how_to_read("test accuracy (%)", "HPO seeds"), ""]
    return "\n".join(lines)


def run(oracle_paths: list[Path], seed_paths: list[Path], csv_path: Path, md: Path, js: Path):
    from dpadapter.ground.tables import write_csv

    def key(p: Path) -> tuple[str, str]:
        # .../hpo-probe/{upstream}/{task}/<file>
        return p.parent.parent.name, p.parent.name

    oracles = {key(Path(p)): json.loads(Path(p).read_text()) for p in oracle_paths}
    seeds: dict[tuple[str, str], list[dict]] = {}
    for p in seed_paths:
        seeds.setdefault(key(Path(p)), []).append(json.loads(Path(p).read_text()))
    rows, result = summarise(oracles, seeds)
    write_csv(rows, csv_path, COLUMNS)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(result))
    js.write_text(json.dumps(result, indent=1))
    return result
