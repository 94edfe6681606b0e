"""Privacy of full-batch DP-GD on a linear head: every example is used at every step (q = 1).

There is no subsampling, and so no amplification; each step is one Gaussian mechanism of
l2-sensitivity C under add/remove-one neighbours (the clipped sum changes by at most C), and T
steps compose exactly to one Gaussian mechanism with noise multiplier sigma / sqrt(T)
(`hpo.accounting._segment_pld` builds that PLD with dp-accounting). So a run is calibrated once
per budget, as a single release, whatever its T. This is what the accountant assumes and what
`dpgd` does; `ACCOUNTING` is recorded in every output.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dpadapter.hpo.accounting import Composition, compose, epsilon_of, history_pld
from dpadapter.privacy import Search, Segment, smallest_sigma

# sigma of one full-batch release: bracket by powers of two (down to 1e-4), then a geometric
# bisection to 0.1 %
SINGLE_RELEASE = Search(start=1.0, cap=1e8, shrink_to=1e-4, midpoint="geometric", ratio=1.001)

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
    return smallest_sigma(lambda s: _eps_single(s, delta), epsilon, SINGLE_RELEASE)


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

    return smallest_sigma(total, target, dataclasses.replace(SINGLE_RELEASE, cap=None))
