"""The search space of the linear scaling rule: one scalar, the total step size r = lr * T.

Panda et al. (2024, Sec. 4.1) bound the distance between noisy and noise-free gradient descent
by a term that grows with lr * T, so runs with the same product behave alike and the 2-D search
over (lr, T) collapses to 1-D over r. T counts optimizer steps (releases), never epochs: epochs
would tie r to the sampling rate and hide partial epochs from the accountant.

Everything here is a pure function of the config and an explicit random generator, so the
privacy parameters of every run can be fixed before any private data is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepConfig:
    """One training configuration: learning rate, optimizer steps, and their product r."""

    lr: float
    steps: int

    @property
    def r(self) -> float:
        return self.lr * self.steps


@dataclass(frozen=True)
class SearchSpace:
    """lr in [lr_min, lr_max], T in [steps_min, steps_max]; r on a log grid between the ends."""

    lr_min: float
    lr_max: float
    steps_min: int
    steps_max: int
    grid_size: int

    def __post_init__(self) -> None:
        if not 0 < self.lr_min <= self.lr_max:
            raise ValueError(f"need 0 < lr_min <= lr_max, got {self.lr_min}, {self.lr_max}")
        if not 1 <= self.steps_min <= self.steps_max:
            raise ValueError(
                f"need 1 <= steps_min <= steps_max, got {self.steps_min}, {self.steps_max}"
            )
        if self.grid_size < 2:
            raise ValueError(f"grid_size must be >= 2, got {self.grid_size}")

    @property
    def r_min(self) -> float:
        return self.lr_min * self.steps_min

    @property
    def r_max(self) -> float:
        return self.lr_max * self.steps_max

    def grid(self) -> tuple[float, ...]:
        """Log-spaced r from r_min to r_max (both ends included)."""
        return tuple(float(r) for r in np.geomspace(self.r_min, self.r_max, self.grid_size))

    def clamp(self, r: float) -> float:
        """r into [r_min, r_max]: an extrapolated r outside the grid is not trusted."""
        if not math.isfinite(r):
            raise ValueError(f"r must be finite, got {r}")
        return min(max(r, self.r_min), self.r_max)

    def _steps_bounds(self, r: float) -> tuple[int, int]:
        """Integer T with r / T inside [lr_min, lr_max] and T inside its own range."""
        lo = max(self.steps_min, math.ceil(r / self.lr_max - 1e-9))
        hi = min(self.steps_max, math.floor(r / self.lr_min + 1e-9))
        return lo, hi

    def _with_steps(self, r: float, steps: int) -> StepConfig:
        lr = min(max(r / steps, self.lr_min), self.lr_max)
        return StepConfig(lr=lr, steps=int(steps))

    def sample_r(self, rng: np.random.Generator) -> float:
        """Uniform over the grid points (Algorithm 3's 'uniformly sample r')."""
        grid = self.grid()
        return grid[int(rng.integers(len(grid)))]

    def sample_sweep(self, rng: np.random.Generator, n: int) -> tuple[float, ...]:
        """n grid points for one sweep, distinct while the grid has enough of them.

        Each trial's r is still uniform over the grid (Algorithm 3), but a sweep never spends
        two trials on the same r, which raises the chance that it contains the best one.
        """
        grid = self.grid()
        idx = rng.choice(len(grid), size=n, replace=n > len(grid))
        return tuple(grid[int(i)] for i in idx)

    def decompose_random(self, r: float, rng: np.random.Generator) -> StepConfig:
        """T uniform over the feasible integers, lr = r / T (Appendix A.3, method 2).

        If no integer T keeps lr in range (a very narrow lr range), the nearest T is used and lr
        clamped; the returned StepConfig's `r` is then the product actually trained.
        """
        r = self.clamp(r)
        lo, hi = self._steps_bounds(r)
        if lo > hi:
            return self._with_steps(r, min(max(lo, self.steps_min), self.steps_max))
        return self._with_steps(r, int(rng.integers(lo, hi + 1)))

    def decompose_max_steps(self, r: float) -> StepConfig:
        """The most steps with lr >= lr_min: T = steps_max unless r is too small for it.

        The final and grid runs use it: their noise is calibrated for steps_max steps, so taking
        fewer would leave budget unused; a smaller T (a prefix) is taken only when r < lr_min *
        steps_max, and then spends less than accounted.
        """
        r = self.clamp(r)
        lo, hi = self._steps_bounds(r)
        steps = hi if lo <= hi else min(max(lo, self.steps_min), self.steps_max)
        return self._with_steps(r, steps)


@dataclass(frozen=True)
class ScalingFit:
    """r(eps) as a polynomial (coefficients highest degree first, numpy.polyval order)."""

    kind: str
    coeffs: tuple[float, ...]
    points: tuple[tuple[float, float], ...]

    def predict(self, eps: float) -> float:
        return float(np.polyval(self.coeffs, eps))

    @property
    def slope(self) -> float:
        """dr/deps of a line (alpha in Algorithm 2); for a quadratic, at eps = 0."""
        return float(self.coeffs[-2])

    @property
    def intercept(self) -> float:
        return float(self.coeffs[-1])


def fit_scaling(points: Sequence[tuple[float, float]], kind: str = "linear") -> ScalingFit:
    """Line (Algorithm 2) or quadratic (Table 15) through (eps_k, best r_k).

    With exactly degree + 1 points the polynomial interpolates them; with more it is the least
    squares fit. Budgets must be distinct, or the slope is undefined.
    """
    degree = {"linear": 1, "quadratic": 2}.get(kind)
    if degree is None:
        raise ValueError(f"unknown fit {kind!r}; use 'linear' or 'quadratic'")
    pts = tuple((float(e), float(r)) for e, r in points)
    if len(pts) < degree + 1:
        raise ValueError(f"a {kind} fit needs at least {degree + 1} points, got {len(pts)}")
    eps = [e for e, _ in pts]
    if len(set(eps)) != len(eps):
        raise ValueError(f"sweep budgets must be distinct, got {eps}")
    coeffs = np.polyfit(eps, [r for _, r in pts], degree)
    return ScalingFit(kind, tuple(float(c) for c in coeffs), pts)


def space_of(cfg) -> SearchSpace:
    """The config's search space (`hpo.lr_range`, `steps_range`, `grid_size`), both regimes."""
    h = cfg.hpo
    return SearchSpace(
        h.lr_range[0], h.lr_range[1], h.steps_range[0], h.steps_range[1], h.grid_size
    )


def step_dict(c: StepConfig) -> dict:
    """How a configuration is written into every output (r first, so a reader sees the rule)."""
    return {"r": c.r, "lr": c.lr, "steps": c.steps}


def step_from(d: dict) -> StepConfig:
    """The configuration of a `step_dict` (r is derived, so it is not read back)."""
    return StepConfig(lr=float(d["lr"]), steps=int(d["steps"]))
