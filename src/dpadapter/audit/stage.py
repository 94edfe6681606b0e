"""The audit stage's jobs and table: one `audit.json` per algorithm x epsilon, then a summary.

The grid iterates over the algorithm registry (`audit.algorithms` empty = every registered
algorithm), so a newly registered algorithm is audited without touching this file; the
federated mechanisms in `audit.federated` join it as `federated-<mechanism>`.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from dpadapter.audit.checks import FEDERATED_PREFIX, check
from dpadapter.registries import catalog
from dpadapter.settings import Config
from dpadapter.settings.grid import grid

COLUMNS = (
    "algorithm",
    "target_epsilon",
    "claimed_epsilon",
    "epsilon_lb",
    "canaries",
    "guesses",
    "correct",
    "score",
    "k",
    "within_claim",
)


def audit_algorithms(cfg: Config) -> list[str]:
    return list(cfg.audit.algorithms) or sorted(catalog.algorithms())


def audit_jobs(cfg: Config) -> list[tuple[str, float]]:
    """Every (algorithm, epsilon) the audit runs: algorithms, then federated mechanisms."""
    names = audit_algorithms(cfg) + [FEDERATED_PREFIX + m for m in cfg.audit.federated]
    return grid(names, [float(e) for e in cfg.audit.epsilons])


def run(cfg: Config, algo: str, eps: float, out_dir: Path) -> dict:
    """One audited run; writes `out_dir/audit.json` (atomically, only once it is complete)."""
    check(cfg)
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be positive and finite, got {eps}")
    # here, not at the top: the workflow reads this module's grid (audit_jobs) at parse time
    import torch

    from dpadapter.train.job import write_json

    torch.set_num_threads(int(os.environ.get("DPADAPTER_THREADS", torch.get_num_threads())))
    if algo.startswith(FEDERATED_PREFIX):
        from dpadapter.audit.federated import audit_federated_run

        record = audit_federated_run(cfg, algo.removeprefix(FEDERATED_PREFIX), eps)
    else:
        from dpadapter.audit.canaries import audit_run

        record = audit_run(cfg, algo, eps)
    write_json(Path(out_dir) / "audit.json", record)
    return record


def rows(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        b = r["best_test"]
        out.append(
            {
                "algorithm": r["algorithm"],
                "target_epsilon": r["target_epsilon"],
                "claimed_epsilon": round(r["claimed_epsilon"], 4),
                "epsilon_lb": round(r["epsilon_lb"], 4),
                "canaries": r["canaries"],
                "guesses": r["guesses"],
                "correct": r["correct"],
                "score": b["score"],
                "k": b["k"],
                "within_claim": r["within_claim"],
            }
        )
    return out


def markdown(table: list[dict], confidence: float) -> str:
    from dpadapter.ground.tables import SINGLE, Stat, flagged_cells, how_to_read

    # One run per cell: each bound is marked n = 1, and a bound that falls as the claim rises is
    # flagged as for accuracy (with one run the drop cannot be told from noise).
    lb = flagged_cells(
        ((r["algorithm"], r["target_epsilon"], Stat(r["epsilon_lb"], 0.0, 1)) for r in table),
        scale=1.0,
        digits=3,
    )
    lines = [
        f"# Empirical privacy audit (one run, {confidence:.0%} lower bounds)",
        "",
        "| algorithm | claimed ε | ε_lb | canaries | guesses | correct | best test | ε_lb ≤ ε |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['algorithm']} | {r['claimed_epsilon']:.3f} | "
            f"{lb[(r['algorithm'], float(r['target_epsilon']))]} | "
            f"{r['canaries']} | {r['guesses']} | {r['correct']} | {r['score']}, k={r['k']} | "
            f"{'yes' if r['within_claim'] else '**NO**'} |"
        )
    lines += [
        "",
        "claimed ε: recomputed from the run's privacy ledger (what the pipeline prints; target "
        "ε in audit.csv). ε_lb: largest ε rejected by the exact one-run test of Steinke, Nasr "
        "& Jagielski (2023), maximised over the (score, k) tests with a Bonferroni correction. "
        "See docs/audit.md for what a bound below the claim does and does not prove.",
        "",
        how_to_read("ε lower bound", "audited runs", upper_bounds=False)
        + f" Every bound here comes from one run ({SINGLE}); the claimed ε is the accountant's "
        "upper bound over every step of the run.",
    ]
    return "\n".join(lines) + "\n"


def summary(paths: list[Path], csv_out: Path, md_out: Path, fig_out: Path) -> list[dict]:
    import json

    from dpadapter.audit.plots import lower_bound_vs_claim

    records = [json.loads(Path(p).read_text()) for p in paths]
    table = rows(records)
    csv_out.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(table)
    conf = records[0]["confidence"] if records else 0.95
    md_out.write_text(markdown(table, conf))
    lower_bound_vs_claim(table, fig_out)
    return table
