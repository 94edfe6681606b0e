"""The network regime's final budget: the per-run epsilon e_f of the final run such that every
trial, every selection and the final run compose to at most `hpo.target_epsilon`.

The final run is calibrated by its own algorithm (sigma from a per-run epsilon, with the
configured PRV or RDP accountant) while the HPO total is a PLD composition, so e_f is found by
evaluating whole planned histories, not from a closed form.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dpadapter.hpo.accounting import Composition, compose, epsilon_of, history_pld
from dpadapter.privacy import CalibrationError, Search, Segment, smallest_sigma

COARSE = 1e-3  # for the starting guess of the final budget only; never for a reported epsilon
# The guess's sigma: powers of two (down to 1e-3), then a geometric bisection to 0.5 %.
GUESS = Search(start=1.0, cap=1e6, shrink_to=1e-3, midpoint="geometric", ratio=1.005)


class BudgetError(ValueError):
    """The trials and selections alone leave no budget for the final run."""


def final_epsilon_guess(
    spent: Composition,
    delta: float,
    target: float,
    sample_rate: float,
    steps: int,
    accountant: str,
) -> float:
    """Per-run epsilon of the constant-sigma final run that would meet the target exactly.

    The search over sigma uses PLDs only (fractions of a second each); the result is converted
    to the per-run epsilon that the run's own accountant (PRV or RDP) assigns to that sigma,
    which is what an algorithm is calibrated from. For a constant-sigma algorithm this is (up
    to the calibration tolerance) the answer, so `calibrate_final_epsilon` usually needs one
    calibration instead of a dozen; for others it is only a starting point.
    """
    from dpadapter.privacy import epsilon_from_history

    base = spent.pld(COARSE)

    def total(sigma: float) -> float:
        final = history_pld([Segment(sigma, sample_rate, steps)], COARSE)
        return epsilon_of(compose([base, final]), delta)

    try:
        hi = smallest_sigma(total, target, GUESS)
    except CalibrationError as exc:
        raise BudgetError(f"no noise level keeps the total within {target}") from exc
    return epsilon_from_history([Segment(hi, sample_rate, steps)], delta, accountant)


def calibrate_final_epsilon(
    spent: Composition,
    delta: float,
    target: float,
    planned_final: Callable[[float], list[Segment]],
    guess: float | None = None,
    tol: float = 0.01,
    max_evals: int = 25,
) -> tuple[float, list[Segment], float]:
    """Per-run epsilon e_f of the final run such that everything meets the target.

    `planned_final(e)` is the history the final run would record when its algorithm is
    calibrated for per-run epsilon e (sigma grows as e falls, so the total is increasing in e).
    Returns (e_f, its planned history, total epsilon of spent + final) with the total within
    the target and, unless `max_evals` runs out, above (1 - tol) * target. Each evaluation
    calibrates sigma (seconds with PRV), so the root is found by regula falsi (Illinois
    variant) from `guess` (default sqrt(target^2 - spent^2): additive mu's of nearly Gaussian
    losses). e_f may exceed the target when the run's accountant is looser than PLD (RDP).
    Only evaluated, feasible points are returned.
    """
    base = spent.pld()
    base_eps = epsilon_of(base, delta)
    if base_eps >= target:
        raise BudgetError(
            f"trials and selections already spend epsilon {base_eps:.4f} >= target {target}; "
            "lower hpo.sweep_epsilons, trials_per_sweep or the selection cost"
        )

    def total(e: float) -> tuple[float, list[Segment]]:
        hist = planned_final(e)
        return epsilon_of(compose([base, history_pld(hist)]), delta), hist

    # g(e) = total(e) - target, increasing; g(0) = base_eps - target < 0 (no final run).
    lo, g_lo = 0.0, base_eps - target
    hi: float | None = None
    g_hi = math.inf
    best: tuple[float, list[Segment], float] | None = None
    e = guess if guess and guess > 0 else math.sqrt(target**2 - base_eps**2)
    side = 0
    for _ in range(max_evals):
        tot, hist = total(e)
        g = tot - target
        if g <= 0:
            lo, g_lo, best = e, g, (e, hist, tot)
            if -g <= tol * target:
                break
            if side < 0:
                g_hi /= 2
            side = -1
        else:
            hi, g_hi = e, g
            if side > 0:
                g_lo /= 2
            side = 1
        if hi is None:  # no infeasible point yet: step up, by the shortfall's ratio
            e = lo * min(2.0, max(1.02, target / max(tot, 1e-12)))
            continue
        if hi - lo <= 1e-6 * target:
            break
        margin = 0.01 * (hi - lo)
        e = min(max(hi - g_hi * (hi - lo) / (g_hi - g_lo), lo + margin), hi - margin)
    if best is None or not math.isfinite(best[2]):
        raise BudgetError(f"no positive final budget keeps the total within {target}")
    return best
