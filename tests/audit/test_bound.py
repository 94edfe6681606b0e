"""The one-run test's statistics against closed forms, brute force and a simulated eps-DP game."""

import math

import pytest
import torch

from dpadapter.audit.bound import epsilon_lower_bound, guess_counts, p_value


def _binom_sf(v: int, r: int, q: float) -> float:
    return sum(math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(v, r + 1))


@pytest.mark.parametrize("r", [10, 100, 500])
@pytest.mark.parametrize("alpha", [0.05, 0.01])
def test_all_correct_pure_dp_matches_closed_form(r, alpha):
    # delta = 0, v = r: p-value q^r, so the bound solves q^r = alpha, eps = logit(q).
    q = alpha ** (1 / r)
    assert epsilon_lower_bound(r, r, r, 0.0, alpha) == pytest.approx(
        math.log(q / (1 - q)), abs=1e-6
    )


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [
        (50, 40, 30, 0.5, 0.0),
        (50, 40, 30, 0.5, 1e-3),
        (200, 100, 80, 1.2, 1e-5),
        (20, 20, 0, 1.0, 0.1),
    ],
)
def test_p_value_is_the_exact_binomial_tail_plus_the_delta_term(m, r, v, eps, delta):
    q = 1 / (1 + math.exp(-eps))
    pmf = [math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(r + 1)]
    alpha = max((sum(pmf[v - i : v]) / i for i in range(1, v + 1)), default=0.0)
    want = min(1.0, _binom_sf(v, r, q) + 2 * m * delta * alpha)
    assert p_value(m, r, v, eps, delta) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_bound_is_monotone():
    m, r = 1000, 400
    by_v = [epsilon_lower_bound(m, r, v, 1e-5) for v in range(200, 401, 20)]
    assert by_v == sorted(by_v) and by_v[0] == 0.0 and by_v[-1] > 3
    by_delta = [epsilon_lower_bound(m, r, 350, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
    assert by_delta == sorted(by_delta, reverse=True) and by_delta[0] > by_delta[-1]
    by_conf = [epsilon_lower_bound(m, r, 350, 1e-5, a) for a in (0.1, 0.05, 0.01)]
    assert by_conf == sorted(by_conf, reverse=True)
    # the bound is where the p-value crosses alpha
    e = epsilon_lower_bound(m, r, 350, 1e-5)
    assert p_value(m, r, 350, e, 1e-5) < 0.05 <= p_value(m, r, 350, e + 1e-3, 1e-5)


def test_bound_holds_for_eps_dp_randomized_response():
    """Coverage: guesses of an eps-DP game (each right with prob e^eps/(1+e^eps)); the 95% bound
    may exceed eps in at most about 5% of trials. (An off-by-one tail or a normal approximation
    still passes this at r = 200; the closed-form and brute-force tests above catch those.)"""
    eps, r, trials = 1.0, 200, 400
    g = torch.Generator().manual_seed(0)
    q = 1 / (1 + math.exp(-eps))
    v = (torch.rand(trials, r, generator=g) < q).sum(1).tolist()
    over = sum(epsilon_lower_bound(r, r, int(k), 0.0) > eps for k in v)
    assert over <= 0.05 * trials + 3 * math.sqrt(0.05 * 0.95 * trials)
    assert over > 0  # it is a 95% bound, not a vacuous one


def test_guess_counts_takes_top_and_bottom_k():
    scores = [0.1, 0.9, 0.5, -1.0, 0.7, 0.0]
    members = [False, True, False, False, True, True]
    # top 2: indices 1, 4 (members); bottom 2: 3, 5 -> 5 is a member (wrong)
    assert guess_counts(scores, members, 2, 2) == (4, 3)
    assert guess_counts(scores, members, 0, 0) == (0, 0)
    with pytest.raises(ValueError):
        guess_counts(scores, members, 4, 3)
