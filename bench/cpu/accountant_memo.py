"""The accountant work of one fine-tuning job, with and without the per-order RDP memo.

A DP job calibrates sigma for its (epsilon, delta, q, steps) and then evaluates epsilon from its
recorded history after every epoch, all with Opacus' PRV accountant. This times that work in one
process, three ways, alternating so that drift hits them alike:

- `opacus`: Opacus' own `_compute_rdp` for every value (what the code did before the memo);
- `memo, cold`: the memo emptied first (a job's own process, or a preforked child);
- `memo, warm`: the memo as the previous repetition left it (a process that repeats the same
  calibration: the test workers, a resumed run, HPO trials of one budget).

Every variant must give the same sigma and the same epsilons, bit for bit; the script stops
otherwise. Defaults: the embedded default's fine-tuning job (q = 200/2000, 6 epochs of 10 steps,
delta 1e-5, epsilon 1 and 4).

    .venv/bin/python bench/cpu/accountant_memo.py [--repeats 3] [--steps-per-epoch 10 --epochs 6]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from opacus.accountants.analysis import rdp as analysis

from dpadapter.privacy import rdp_memo
from dpadapter.privacy.accounting import Segment, epsilon_from_history
from dpadapter.privacy.calibration import _calibrate


def job(target: float, delta: float, q: float, per_epoch: int, epochs: int) -> tuple:
    sigma = _calibrate(target, delta, q, per_epoch * epochs, "prv")
    eps = [
        epsilon_from_history([Segment(sigma, q, per_epoch * e)], delta, "prv")
        for e in range(1, epochs + 1)
    ]
    return sigma, eps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sample-rate", type=float, default=0.1)
    ap.add_argument("--steps-per-epoch", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0])
    args = ap.parse_args()

    epsilon_from_history([Segment(1.0, 0.1, 1)], 1e-5, "prv")  # installs the memo
    memo = analysis._compute_rdp

    def run(variant: str) -> tuple[float, list]:
        if variant == "memo, cold":
            memo.cache_clear()
        context = rdp_memo.bypassed(analysis) if variant == "opacus" else contextlib.nullcontext()
        with context:
            t = time.perf_counter()
            out = [
                job(e, args.delta, args.sample_rate, args.steps_per_epoch, args.epochs)
                for e in args.epsilons
            ]
            return time.perf_counter() - t, out

    variants = ["opacus", "memo, cold", "memo, warm"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    results = {}
    for _ in range(args.repeats):
        for v in variants:
            seconds, out = run(v)
            times[v].append(seconds)
            results.setdefault(v, out)
            if out != results["opacus"]:
                raise SystemExit(f"{v} gave {out}, Opacus alone {results['opacus']}")
    base = statistics.median(times["opacus"])
    print(
        f"accountant work of one job per epsilon (calibration + {args.epochs} per-epoch "
        f"epsilons), epsilon {args.epsilons}, q {args.sample_rate}, "
        f"{args.steps_per_epoch * args.epochs} steps; median of {args.repeats}:"
    )
    print("| variant | seconds | / opacus |\n|---|---|---|")
    for v in variants:
        m = statistics.median(times[v])
        print(f"| {v} | {m:.2f} | {m / base:.2f} |")
    print("sigma and every epsilon identical in all three:", [r[0] for r in results["opacus"]])


if __name__ == "__main__":
    main()
