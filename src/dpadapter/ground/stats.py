"""Confidence intervals for the validity checks: one home for how spread is reported.

- `t_interval`: Student-t interval for a mean over independent replicates (HPO seeds). With
  five replicates a bootstrap interval is too narrow (it cannot see beyond the five values), the
  t-interval is the standard small-sample choice; it assumes roughly normal replicates.
- `binomial_interval`: Wilson score or Clopper-Pearson (exact) interval for a hit rate, from
  scipy (`BinomTestResult.proportion_ci`), not written by hand.
- `paired_interval`: the mean of paired differences and its paired t interval (scipy's
  `ttest_1samp(...).confidence_interval`).
- `pooled_paired`: the mean of paired differences over cells and seeds from an additive model
  with cell and seed effects (statsmodels' OLS), its interval and residual spread.
- `detectable_difference`: the smallest true difference a t test on that estimate detects with
  a given power (scipy's noncentral t), for the power statement under a table.
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


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of paired differences and its paired Student-t interval (n = 1: unbounded)."""
    from scipy import stats

    xs = [float(v) for v in diffs]
    if len(xs) < 2:
        return t_interval(xs, level)
    ci = stats.ttest_1samp(xs, 0.0).confidence_interval(confidence_level=level)
    return Interval(sum(xs) / len(xs), float(ci.low), float(ci.high), level, "paired t", len(xs))


def pooled_paired(rows: Sequence[tuple[str, object, float]], level: float = 0.95) -> dict | None:
    """(cell, seed, difference) rows -> the mean difference over cells from `d ~ cell + seed`.

    Sum-to-zero coding makes the intercept the mean over cells (and seeds) of the differences;
    its interval comes from the residuals left after both effects, with N - cells - seeds + 1
    degrees of freedom. With too few rows for both effects, the seed effect is dropped (said in
    `model`); with no residual degrees of freedom at all, None.
    """
    import pandas as pd
    import statsmodels.formula.api as smf

    df = pd.DataFrame(rows, columns=["cell", "seed", "d"]).astype({"seed": str})
    n_cells, n_seeds = df["cell"].nunique(), df["seed"].nunique()
    terms = []
    if n_cells > 1:
        terms.append("C(cell, Sum)")
    if n_seeds > 1 and len(df) - n_cells - n_seeds + 1 > 0:
        terms.append("C(seed, Sum)")
    formula = "d ~ " + (" + ".join(terms) if terms else "1")
    resid_df = (
        len(df) - 1 - sum((n_cells - 1) if t.startswith("C(cell") else (n_seeds - 1) for t in terms)
    )
    if resid_df < 1:
        return None
    fit = smf.ols(formula, data=df).fit()
    low, high = (float(v) for v in fit.conf_int(alpha=1 - level).loc["Intercept"])
    return {
        "estimate": float(fit.params["Intercept"]),
        "low": low,
        "high": high,
        "level": level,
        "se": float(fit.bse["Intercept"]),
        "df": float(fit.df_resid),
        "residual_sd": float(fit.mse_resid**0.5),
        "n": len(df),
        "cells": int(n_cells),
        "seeds": int(n_seeds),
        "model": formula,
    }


def detectable_difference(
    se: float, df: float, power: float = 0.8, alpha: float = 0.05
) -> float | None:
    """The smallest true difference a two-sided t test (standard error `se`, `df` degrees of
    freedom) rejects zero for with probability `power` (scipy's noncentral t); None when
    there is no test (df < 1 or no spread)."""
    from scipy import optimize, stats

    if df < 1 or not se > 0 or not math.isfinite(se):
        return None
    crit = float(stats.t.ppf(1 - alpha / 2, df))

    def shortfall(nc: float) -> float:
        # the far tail below -crit is negligible for nc > 0, and scipy's nct gives NaN for it
        # at a large nc: taken as 0 there
        lower = float(stats.nct.cdf(-crit, df, nc))
        return float(stats.nct.sf(crit, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    # the power at a noncentrality of crit + 10 is ~1; scipy's nct is NaN far beyond
    return float(optimize.brentq(shortfall, 0.0, crit + 10.0)) * se
