"""Confidence intervals for the validity checks: one home for how spread is reported.

- `t_interval`: Student-t interval for a mean over independent replicates (HPO seeds). With
  five replicates a bootstrap interval is too narrow (it cannot see beyond the five values), the
  t-interval is the standard small-sample choice; it assumes roughly normal replicates.
- `binomial_interval`: Wilson score or Clopper-Pearson (exact) interval for a hit rate, from
  scipy (`BinomTestResult.proportion_ci`), not written by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    level: float
    method: str
    n: int

    def as_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "level": self.level,
            "method": self.method,
            "n": self.n,
        }

    def text(self, fmt: str = "{:.3f}", scale: float = 1.0) -> str:
        e, lo, hi = (fmt.format(v * scale) for v in (self.estimate, self.low, self.high))
        return f"{e} [{lo}, {hi}] ({self.level:.0%} {self.method}, n={self.n})"


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and its two-sided Student-t interval; n = 1 gives an unbounded interval."""
    from scipy import stats

    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        raise ValueError("need at least one value")
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, -math.inf, math.inf, level, "t", n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, level, "t", n)


def binomial_interval(
    successes: int, trials: int, level: float = 0.95, method: str = "wilson"
) -> Interval:
    """Hit rate k/n with a Wilson (`wilson`) or Clopper-Pearson (`exact`) interval."""
    from scipy import stats

    if trials <= 0 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials > 0, got {successes}/{trials}")
    ci = stats.binomtest(int(successes), int(trials)).proportion_ci(
        confidence_level=level, method=method
    )
    name = {"wilson": "Wilson", "exact": "Clopper-Pearson"}.get(method, method)
    return Interval(successes / trials, float(ci.low), float(ci.high), level, name, trials)
