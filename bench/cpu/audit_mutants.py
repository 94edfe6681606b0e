"""Which broken mechanisms the default audit sees: every test-only mutant on the embedded setting.

    .venv/bin/python bench/cpu/audit_mutants.py [--config config.yaml] [--out /tmp/audit_mutants]

Runs the `audit` section of the config (default m, epsilons) on each mutant of
tests/audit/audit_mutants.py (never registered outside this process) and prints, per mutant and
epsilon, the claimed epsilon (ledger), the lower bound and whether the audit refutes the claim.
Results go to a temporary results_dir, never the repository's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "audit"))

import audit_mutants as M  # noqa: E402

from dpadapter.algorithms import ALGORITHMS  # noqa: E402
from dpadapter.audit.canaries import audit_run  # noqa: E402
from dpadapter.settings import load  # noqa: E402

MUTANTS = {
    "non-private (sigma=0, no clipping)": M.NonPrivate,
    "noise / 10, ledger records sigma": M.NoiseDividedBy10,
    "clipping skipped: weight (canary layer)": M.ClipSkippedForWeight,
    "clipping skipped: bias": M.ClipSkippedForBias,
    "ledger reset at half the steps": M.LedgerResetMidRun,
}


def _row(label: str, eps: float, r: dict, t0: float) -> dict:
    """One audited run as a table row, printed as it comes."""
    row = {
        "mutant": label,
        "target_epsilon": eps,
        "claimed_epsilon": round(r["claimed_epsilon"], 3),
        "epsilon_lb": round(r["epsilon_lb"], 3),
        "correct": f"{r['correct']}/{r['guesses']}",
        "refuted": not r["within_claim"],
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def federated_noise_div10(cfg) -> list[dict]:
    """Federated Gaussian clients adding sigma/10 while their ledgers record sigma (client 0)."""
    import dpadapter.audit.federated as F
    from dpadapter.federated.simulation import MechanismRun

    plan, acc = F.plan_noise, MechanismRun.accounted_multiplier
    F.plan_noise = lambda *a: (plan(*a)[0] / 10, None, 0.0)
    MechanismRun.accounted_multiplier = property(lambda s: s.noise_multiplier * 10)
    out = []
    try:
        for eps in cfg.audit.epsilons:
            t0 = time.time()
            r = F.audit_federated_run(cfg, "gaussian", eps)
            out.append(_row("federated gaussian, noise / 10, ledgers record sigma", eps, r, t0))
    finally:
        F.plan_noise, MechanismRun.accounted_multiplier = plan, acc
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "config.yaml"))
    ap.add_argument("--out", default="/tmp/audit_mutants")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of mutant labels")
    args = ap.parse_args()
    cfg = load(args.config)
    cfg = dataclasses.replace(cfg, results_dir=args.out)
    rows = []
    for label, cls in MUTANTS.items():
        if args.only and not any(o in label for o in args.only):
            continue
        name = f"mutant-{cls.__name__.lower()}"
        ALGORITHMS[name] = type(cls.__name__, (cls,), {"name": name})
        try:
            for eps in cfg.audit.epsilons:
                t0 = time.time()
                rows.append(_row(label, eps, audit_run(cfg, name, eps), t0))
        finally:
            del ALGORITHMS[name]
    if not args.only or any("federated" in o for o in args.only):
        rows += federated_noise_div10(cfg)
    print("\n| mutant | claimed ε | ε_lb | correct/guesses | claim refuted |")
    print("|---|---|---|---|---|")
    for x in rows:
        print(
            f"| {x['mutant']} | {x['claimed_epsilon']} | {x['epsilon_lb']} | {x['correct']} | "
            f"{'yes' if x['refuted'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
