"""Epsilon in, noise out: the one search for the smallest noise that keeps a history in budget.

Every noise level the pipeline sets from a target epsilon comes from `smallest_sigma`: the
constant-sigma runs of every algorithm (`calibrate_sigma`, Opacus' own search), AdpAlloc's
decaying schedule, the federated training noise composed with its estimation release, and the
HPO's single-release and final-run noise (PLD compositions). Callers hand it `epsilon(sigma)`,
the accountant's epsilon of the history that sigma would produce, and a `Search` saying how
to bracket and narrow; it bounds the time and iterations, names what failed, and caches.

Written here because Opacus calibrates one constant segment only and its search has no lower
bound on sigma, no iteration cap and no time limit; dp-accounting calibrates single mechanisms.
The searches keep each caller's historical tolerances, so every sigma is the one it was.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpadapter.privacy import genuine
from dpadapter.privacy.accounting import (
    EPS_ERROR,
    Segment,
    accountant_version,
    epsilon_from_history,
    rdp_epsilon,
)
from dpadapter.privacy.genuine import accountant_is_genuine
from dpadapter.privacy.memo import cached, sealed

# Calibration range. Below SIGMA_MIN the noise is negligible (epsilon in the hundreds for any
# usual grid) and PRV's numerics overflow (inf, ~10 s an evaluation): a target epsilon that
# only such a sigma reaches is refused rather than searched for (epsilon 1e5 once searched for
# 66 minutes). Above SIGMA_MAX the budget is too small for any training.
SIGMA_MIN = 0.3
SIGMA_MAX = 1e4
CALIBRATION_SECONDS = 300.0  # wall-clock bound of one calibration
CALIBRATION_ITERATIONS = 100


class CalibrationError(ValueError):
    """No noise multiplier in the calibration range meets the target, or a planned history
    (its sigma perhaps read from the memo) overspends it; the message says why."""


@dataclass(frozen=True)
class Search:
    """How `smallest_sigma` brackets the answer and narrows the bracket.

    Bracketing: the upper end starts at `start` and is multiplied by `grow` while it overspends
    (refused past `cap`); the lower end starts at `low` and, with `low_follows`, moves up to
    each overspending upper end. With `shrink_to`, the lower end then starts at upper / grow
    and halves while it is within budget (the answer lies below the first feasible power).
    Narrowing: `midpoint` arithmetic (Opacus'), geometric, or `illinois` (regula falsi on
    log epsilon against log sigma: fewest evaluations, for histories that cost seconds each);
    it stops at the first of: the feasible end within `eps_tol` of the target (or, with
    `log_tol`, log target - log epsilon <= log_tol), the bracket within `rel_width`
    (arithmetic: (hi - lo) / hi; geometric and illinois: hi / lo - 1), or hi / lo <= `ratio`.
    """

    start: float
    grow: float = 2.0
    cap: float | None = None
    low: float = 0.0
    low_follows: bool = False
    shrink_to: float | None = None
    midpoint: str = "arithmetic"
    eps_tol: float | None = None
    log_tol: float | None = None
    rel_width: float | None = None
    ratio: float | None = None
    try_low: bool = False  # return `low` at once if it is within budget


def smallest_sigma(
    epsilon: Callable[[float], float],
    target: float,
    search: Search,
    *,
    where: str = "",
    cache: str | Path | None = None,
    key: str | None = None,
    max_seconds: float = CALIBRATION_SECONDS,
) -> float:
    """The smallest sigma (to the search's tolerance) with epsilon(sigma) <= target.

    The returned end was always evaluated as within budget. `cache` and `key` memoise the
    result in a JSON file shared by the jobs of a grid (`cached`).
    """
    if cache is not None and key is not None:
        return cached(cache, key, lambda: _search(epsilon, target, search, where, max_seconds))
    return _search(epsilon, target, search, where, max_seconds)


def _search(
    epsilon: Callable[[float], float],
    target: float,
    s: Search,
    where: str,
    max_seconds: float,
) -> float:
    started = time.monotonic()
    where = where or f"target epsilon {target:g}"

    def eps(sigma: float) -> float:
        if time.monotonic() - started > max_seconds:
            raise CalibrationError(
                f"sigma calibration for {where} did not converge in {max_seconds:.0f} s; "
                "use a smaller epsilon, or privacy.accountant: rdp"
            )
        value = float(epsilon(sigma))
        return math.inf if math.isnan(value) else value

    lo, eps_lo = s.low, math.inf
    if s.try_low:
        eps_lo = eps(lo)
        if eps_lo <= target:
            return lo
    hi = s.start
    eps_hi = eps(hi)
    while eps_hi > target:
        if s.low_follows:
            lo, eps_lo = hi, eps_hi
        hi *= s.grow
        if s.cap is not None and hi > s.cap:
            raise CalibrationError(
                f"{where} needs sigma > {s.cap:g}: the budget is too small for this many "
                "steps; raise epsilon or lower the number of steps"
            )
        eps_hi = eps(hi)
    if s.shrink_to is not None:
        lo = hi / s.grow
        while True:
            eps_lo = eps(lo)
            if not (eps_lo <= target and lo > s.shrink_to):
                break
            hi, eps_hi, lo = lo, eps_lo, lo / 2
    w_lo, w_hi, side = _gap(eps_lo, target), _gap(eps_hi, target), 0
    for _ in range(CALIBRATION_ITERATIONS):
        if _narrow_enough(s, lo, hi, eps_hi, target):
            return float(hi)
        if s.midpoint == "arithmetic":
            mid = (lo + hi) / 2
        elif s.midpoint == "geometric":
            mid = math.sqrt(lo * hi)
        else:  # illinois, in log space; the weights are halved on the side that stays
            x_lo, x_hi = math.log(lo), math.log(hi)
            x = x_hi - w_hi * (x_hi - x_lo) / (w_hi - w_lo)
            mid = math.exp(min(max(x, x_lo + 1e-4 * (x_hi - x_lo)), x_hi - 1e-4 * (x_hi - x_lo)))
        value = eps(mid)
        if value <= target:
            hi, eps_hi = mid, value
            w_hi = _gap(value, target)
            if side == -1:
                w_lo /= 2
            side = -1
        else:
            lo = mid
            w_lo = _gap(value, target)
            if side == 1:
                w_hi /= 2
            side = 1
    raise CalibrationError(
        f"sigma calibration for {where} did not converge in {CALIBRATION_ITERATIONS} steps"
    )


def _gap(value: float, target: float) -> float:
    """log epsilon - log target: the function whose root the illinois search finds."""
    return math.log(value) - math.log(target) if value > 0 else -math.inf


def _narrow_enough(s: Search, lo: float, hi: float, eps_hi: float, target: float) -> bool:
    if s.rel_width is not None:
        if s.midpoint == "arithmetic":
            if hi - lo <= s.rel_width * hi:
                return True
        elif hi / lo <= 1 + s.rel_width:
            return True
    if s.ratio is not None and hi / lo <= s.ratio:
        return True
    if s.log_tol is not None and -_gap(eps_hi, target) <= s.log_tol:
        return True
    return s.eps_tol is not None and target - eps_hi <= s.eps_tol


def verify_plan(
    history: list[Segment], delta: float, accountant: str, target: float, where: str
) -> float:
    """The accountant's epsilon of the releases a run plans, computed now with no memo; refuses
    (CalibrationError) a plan that spends more than `target`.

    Every sigma the calibrations hand out may come from the results folder's memo, which a stale
    or edited folder fills with any number (sigma 0.3 once trained a run whose true epsilon was
    79). Called with the planned history before the first private step, so such a sigma never
    trains; an honest memo entry passes, since its search evaluated this very history within
    budget.
    """
    spent = epsilon_from_history(history, delta, accountant)
    if not spent <= target:  # NaN refuses too
        rows = ", ".join(f"{s.steps} at sigma {s.noise_multiplier:.6g}" for s in history)
        raise CalibrationError(
            f"{where}: the planned releases ({rows}; sample rate "
            f"{history[0].sample_rate if history else 0:.4g}) spend epsilon {spent:.4g} at delta "
            f"{delta:g} ({accountant}), which exceeds the target {target:g}: its sigma was read "
            "from a stale or edited calibration memo (<results_dir>/.cache/) or resume state "
            "(<results_dir>/.resume/); delete it, and sigma is calibrated again"
        )
    return spent


# --- constant sigma: what every algorithm calibrates from its run spec -------------------------
# Opacus' `get_noise_multiplier` search (double from 20, then bisect from 0 to an absolute
# tolerance of 0.005 on epsilon), bounded: sigma is the same as Opacus' for every target it
# could reach.
OPACUS = Search(start=20.0, cap=SIGMA_MAX, eps_tol=0.005)
# In every cache key of a calibration: raise it when the search or the accountant's use changes
# (a cached sigma is then recomputed rather than taken from the old code).
KEY_VERSION = 2


def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    cache: str | Path | None = None,
) -> float:
    """Smallest sigma (to Opacus' tolerance) whose epsilon does not exceed the target.

    The bisection costs seconds with PRV and every job of a grid repeats the same few, so the
    results are cached in a JSON file keyed by every input, and in this process's memory
    (`memo.sealed`, which only the real accountant's values enter). A run never trusts that file: it
    verifies the sigma on its planned history before training (`verify_plan`) and checks the
    spent epsilon, recomputed from its recorded history, at the end.
    """
    key = json.dumps(
        ["sigma", KEY_VERSION, accountant_version(), target_epsilon, delta, sample_rate, steps]
        + [accountant, EPS_ERROR]
    )

    def compute() -> float:
        return _calibrate(target_epsilon, delta, sample_rate, steps, accountant)

    # what the file lacks, this process may have computed for another results folder (the
    # suite's tests, each with its own): from memory, the real accountant's values only
    def computed_in_this_process() -> float:
        return sealed(key, compute, accountant_is_genuine)

    if cache is None:
        return computed_in_this_process()
    return cached(cache, key, computed_in_this_process)


def _calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    max_seconds: float = CALIBRATION_SECONDS,
) -> float:
    where = (
        f"target epsilon {target_epsilon:g} (delta {delta:g}, sample rate {sample_rate:.4g}, "
        f"{steps} steps, {accountant})"
    )

    def eps(sigma: float) -> float:
        return epsilon_from_history([Segment(sigma, sample_rate, steps)], delta, accountant)

    floor = eps(SIGMA_MIN)
    if floor <= target_epsilon:
        raise CalibrationError(
            f"{where} is reachable only with sigma < {SIGMA_MIN} (sigma {SIGMA_MIN} already "
            f"gives epsilon {floor:.4g}): the noise would be negligible and the accountant is "
            f"not reliable there. Use an epsilon below {floor:.4g}, or train without DP "
            "(the `standard` upstream model is non-private)."
        )
    return smallest_sigma(eps, target_epsilon, OPACUS, where=where, max_seconds=max_seconds)


@functools.lru_cache(maxsize=256)
def max_reachable_epsilon(delta: float, sample_rate: float, steps: int) -> float:
    """An upper bound (RDP, fast) on the largest epsilon `calibrate_sigma` can calibrate to.

    The config validation refuses larger targets before any job: RDP's epsilon at SIGMA_MIN
    is at least PRV's, so a target above it is out of reach under either accountant. Opacus'
    RDP accountant's number, computed without importing torch (`rdp_epsilon`).
    """
    import warnings

    with warnings.catch_warnings():  # "optimal order is the smallest alpha": an upper bound
        warnings.simplefilter("ignore", UserWarning)
        return rdp_epsilon([Segment(SIGMA_MIN, sample_rate, steps)], delta)


genuine.record(globals())  # last: the names as imported, which the process memo requires
