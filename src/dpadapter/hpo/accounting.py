"""The privacy cost of a whole HPO: every trial, every selection and the final run, composed.

All releases are composed with dp-accounting's privacy loss distributions (PLD, pessimistic
estimates, so every epsilon is an upper bound): each recorded history segment is `steps`
Poisson-subsampled Gaussian releases, each selection is the PLD of its mechanism
(`selection.py`). Theorem 4.1's mu-composition sqrt(n mu1^2 + n mu2^2 + muf^2) is exact only for
full-batch training; with Poisson sampling it is not, so it is not used.

Adaptivity: the final run's r depends on the trials' results, so its privacy parameters must
not. Every trial's (sigma, q, T) is fixed by the config and the seed before any data is read,
and the final run's noise is calibrated for `steps_max` steps whatever r turns out to be; a
final run that takes fewer steps runs a prefix of that schedule, which is a post-processing of
the full one. So the composition below (trials as recorded, final as planned for steps_max)
bounds the whole adaptive procedure.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dpadapter.privacy import Segment

# Value discretisation of the PLDs. Pessimistic discretisation keeps every epsilon an upper bound
# at any interval; 3e-4 matches 1e-4 (privacy.pld_epsilon's) to ~1e-4 relative on this
# project's histories at a quarter of the cost, which matters with dozens of runs per HPO.
DISCRETIZATION = 3e-4
COARSE = 1e-3  # for the starting guess of the final budget only; never for a reported epsilon


class BudgetError(ValueError):
    """The trials and selections alone leave no budget for the final run."""


def _pld_module():
    from dp_accounting.pld import common, privacy_loss_distribution

    return privacy_loss_distribution, common


@functools.lru_cache(maxsize=512)
def _segment_pld(sigma: float, sample_rate: float, steps: int, discretization: float):
    """PLD of `steps` Poisson-subsampled Gaussian releases (cached: building one takes ~1 s).

    Full batch (q = 1, DP-GD) is no subsampling: each step is the Gaussian mechanism with
    l2-sensitivity 1 (in units of the clipping norm) and noise multiplier sigma under add/remove
    neighbours, and T such steps compose *exactly* to one Gaussian mechanism with noise
    multiplier sigma / sqrt(T) (mu = sqrt(T) / sigma in GDP; Dong, Roth & Su 2022, Cor. 3.3).
    That PLD is built directly: the same bound without T rounds of discretisation error, and the
    same PLD for every (sigma, T) with equal mu, which is what lets the linear-probe HPO pick T
    after a selection without changing the final run's privacy loss.
    """
    pld_mod, _ = _pld_module()
    if sample_rate == 1.0:
        return pld_mod.from_gaussian_mechanism(
            standard_deviation=sigma / math.sqrt(steps),
            value_discretization_interval=discretization,
        )
    return pld_mod.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=sample_rate,
        value_discretization_interval=discretization,
    ).self_compose(steps)


def history_pld(history: Iterable[Segment], discretization: float = DISCRETIZATION):
    """PLD of a run's recorded (or planned) releases; None if it made none."""
    out = None
    for s in history:
        if s.steps <= 0:
            continue
        if not s.noise_multiplier > 0:
            raise ValueError(f"a release without noise is not private: {s}")
        one = _segment_pld(
            float(s.noise_multiplier), float(s.sample_rate), int(s.steps), discretization
        )
        out = one if out is None else out.compose(one)
    return out


def release_pld(release: dict[str, Any], discretization: float = DISCRETIZATION):
    """PLD of one selection release as recorded by `SelectionMechanism.release`."""
    pld_mod, common = _pld_module()
    kind = release["mechanism"]
    if kind == "exponential":
        params = common.DifferentialPrivacyParameters(epsilon=float(release["pure_epsilon"]))
        return pld_mod.from_privacy_parameters(params, value_discretization_interval=discretization)
    if kind == "gaussian":
        return pld_mod.from_gaussian_mechanism(
            standard_deviation=float(release["noise_multiplier"]),
            value_discretization_interval=discretization,
        )
    if kind == "none":
        return None
    raise ValueError(f"unknown selection release {kind!r}")


def compose(plds: Iterable) -> Any:
    out = None
    for p in plds:
        if p is not None:
            out = p if out is None else out.compose(p)
    return out


def epsilon_of(pld, delta: float) -> float:
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


@dataclass(frozen=True)
class Composition:
    """Everything released: run histories and selection releases, and their epsilon at delta."""

    histories: tuple[tuple[Segment, ...], ...]
    releases: tuple[dict[str, Any], ...] = ()

    def pld(self, discretization: float = DISCRETIZATION):
        return compose(
            [
                *(history_pld(h, discretization) for h in self.histories),
                *(release_pld(r, discretization) for r in self.releases),
            ]
        )

    def epsilon(self, delta: float) -> float:
        return epsilon_of(self.pld(), delta)


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Adjacent segments with the same (sigma, q) as one, as the ledger stores them."""
    out: list[Segment] = []
    for s in segments:
        if s.steps <= 0:
            continue
        if out and (out[-1].noise_multiplier, out[-1].sample_rate) == (
            s.noise_multiplier,
            s.sample_rate,
        ):
            out[-1] = Segment(s.noise_multiplier, s.sample_rate, out[-1].steps + s.steps)
        else:
            out.append(Segment(float(s.noise_multiplier), float(s.sample_rate), int(s.steps)))
    return out


def is_prefix(recorded: Sequence[Segment], planned: Sequence[Segment]) -> bool:
    """Whether `recorded` is the first releases of `planned` (equal counts as a prefix)."""
    expand_r = [(s.noise_multiplier, s.sample_rate) for s in recorded for _ in range(s.steps)]
    expand_p = [(s.noise_multiplier, s.sample_rate) for s in planned for _ in range(s.steps)]
    return len(expand_r) <= len(expand_p) and expand_r == expand_p[: len(expand_r)]


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

    hi = 1.0
    while total(hi) > target:
        hi *= 2
        if hi > 1e6:
            raise BudgetError(f"no noise level keeps the total within {target}")
    lo = hi / 2
    while total(lo) <= target and lo > 1e-3:
        hi, lo = lo, lo / 2
    while hi / lo > 1.005:  # total(lo) > target >= total(hi)
        mid = math.sqrt(lo * hi)
        if total(mid) <= target:
            hi = mid
        else:
            lo = mid
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
