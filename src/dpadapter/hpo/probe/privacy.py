"""Privacy of full-batch DP-GD on a linear head: every example is used at every step (q = 1).

There is no subsampling, and so no amplification; each step is one Gaussian mechanism of
l2-sensitivity C under add/remove-one neighbours (the clipped sum changes by at most C), and T
steps compose exactly to one Gaussian mechanism with noise multiplier sigma / sqrt(T)
(`hpo.accounting._segment_pld` builds that PLD with dp-accounting). So a run is calibrated once
per budget, as a single release, whatever its T. This is what the accountant assumes and what
`dpgd` does; `ACCOUNTING` is recorded in every output.
"""

from __future__ import annotations

import functools
import math

from dpadapter.hpo.accounting import Composition, compose, epsilon_of, history_pld
from dpadapter.privacy import Segment

VERSION = 1  # of the oracle's and the replicates' JSON
ACCOUNTING = (
    "full-batch DP-GD: q = 1 (every example at every step, no subsampling amplification); each "
    "step is a Gaussian mechanism of l2-sensitivity C (sum of clipped per-example gradients, "
    "add/remove-one neighbours) normalised by the public n; T steps compose exactly to one "
    "Gaussian with noise multiplier sigma/sqrt(T); totals: dp-accounting PLD (pessimistic) of "
    "all trials + selections + the final run"
)


@functools.lru_cache(maxsize=256)
def single_release_sigma(epsilon: float, delta: float) -> float:
    """Smallest (to 0.1 %) noise multiplier of ONE Gaussian release with eps(delta) <= epsilon.

    A T-step full-batch run then uses sigma * sqrt(T): the same PLD, so the same epsilon.
    """
    hi = 1.0
    while _eps_single(hi, delta) > epsilon:
        hi *= 2
        if hi > 1e8:
            raise ValueError(f"no noise level reaches epsilon {epsilon}")
    lo = hi / 2
    while _eps_single(lo, delta) <= epsilon and lo > 1e-4:
        hi, lo = lo, lo / 2
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if _eps_single(mid, delta) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def _eps_single(sigma: float, delta: float) -> float:
    return epsilon_of(history_pld([Segment(sigma, 1.0, 1)]), delta)


def run_history(sigma_single: float, steps: int) -> tuple[Segment, ...]:
    """The releases of a T-step full-batch run with the PLD of one release at `sigma_single`."""
    return (Segment(sigma_single * math.sqrt(steps), 1.0, int(steps)),)


def final_sigma(spent: Composition, delta: float, target: float) -> float:
    """Single-release noise of the final run so that spent + final stays within `target`."""
    base = spent.pld()
    if epsilon_of(base, delta) >= target:
        raise ValueError(
            f"trials and selections already spend {epsilon_of(base, delta):.4f} >= {target}; "
            "lower hpo.sweep_epsilons, trials_per_sweep or selection_epsilon"
        )

    def total(s: float) -> float:
        return epsilon_of(compose([base, history_pld([Segment(s, 1.0, 1)])]), delta)

    hi = 1.0
    while total(hi) > target:
        hi *= 2
    lo = hi / 2
    while total(lo) <= target and lo > 1e-4:
        hi, lo = lo, lo / 2
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if total(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi
