"""The one-run audit's statistics: guesses in, a lower bound on epsilon out.

Steinke, Nasr & Jagielski (NeurIPS 2023), "Privacy auditing with one (1) training run".
Setting: m canaries, each included independently with probability 1/2 (S_i uniform in
{-1, +1}); after one training run the auditor guesses T_i in {-1, 0, +1} (0 = abstain) and
makes r = sum |T_i| guesses, W of them correct.

- Theorem (pure DP): if training is eps-DP in each canary, then conditioned on r, W is
  stochastically dominated by Binomial(r, e^eps / (1 + e^eps)) -- the accuracy of eps-DP
  randomized response on every guess.
- (eps, delta)-DP: P[W >= v] <= P[Binomial(r, q) >= v] + 2 m delta * max_{i=1..v}
  P[v > Binomial(r, q) >= v - i] / i, with q = e^eps / (1 + e^eps) (their Appendix D code,
  `p_value_DP_audit`, which this reproduces term by term).
- eps_lb at confidence 1 - p: the largest eps whose p-value is still below p, i.e. every
  eps <= eps_lb is rejected (their `get_eps_audit`: doubling then 30+ bisection steps; the
  p-value falls monotonically as eps decreases).

Written by hand because no installed library ships this bound (jax_privacy's auditing module
has it but pulls in JAX); the binomial tails are scipy's exact ones, no normal approximation.
"""

from __future__ import annotations

import math

from scipy import stats


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[>= v correct of r guesses] under (eps, delta)-DP in each of m canaries (an upper bound)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if eps < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need eps >= 0 and 0 <= delta <= 1, got eps={eps}, delta={delta}")
    q = 1.0 / (1.0 + math.exp(-eps))  # accuracy of eps-DP randomized response
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    alpha = 0.0
    if delta > 0 and v > 0:
        pmf = stats.binom.pmf(list(range(v - 1, -1, -1)), r, q)  # P[B = v-1], ..., P[B = 0]
        total = 0.0  # P[v > B >= v - i]
        for i in range(1, v + 1):
            total += float(pmf[i - 1])
            alpha = max(alpha, total / i)
    return min(1.0, beta + alpha * delta * 2 * m)


def epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, alpha: float = 0.05, iters: int = 40
) -> float:
    """Largest eps rejected at level `alpha` (0 when even eps = 0 is not rejected).

    Bisection keeps p_value(eps_lo) < alpha <= p_value(eps_hi); the answer is eps_lo, so the
    rounding errs towards a smaller (more conservative) lower bound.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < alpha:
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # v = r with delta = 0 and huge r; never reached at audit sizes
            return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        if p_value(m, r, v, mid, delta) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


def guess_counts(
    scores: list[float] | tuple[float, ...], members: list[bool], k_pos: int, k_neg: int
) -> tuple[int, int]:
    """(guesses, correct): top `k_pos` scores guessed members, bottom `k_neg` non-members.

    Ties are broken by canary index (the order is fixed before the bits are looked at), so the
    guesses are a function of the scores alone, as the theorem requires.
    """
    m = len(scores)
    if len(members) != m:
        raise ValueError("scores and members differ in length")
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
        raise ValueError(f"need k_pos + k_neg <= m = {m}, got {k_pos} + {k_neg}")
    order = sorted(range(m), key=lambda i: (scores[i], i))
    neg, pos = order[:k_neg], order[m - k_pos :]
    correct = sum(1 for i in pos if members[i]) + sum(1 for i in neg if not members[i])
    return k_pos + k_neg, correct
