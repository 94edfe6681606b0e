"""The T1 rule: closed forms of Theorems 2-3, the decision, and the estimates' sensitivities."""

import math

import pytest
import torch
from fed_helpers import make_data, make_gsm
from torch.utils.data import TensorDataset

from dpadapter.federated.estimate import (
    STAT_NAMES,
    RuleConstants,
    aggregate_constants,
    aggregated_noise_var,
    client_constants,
    client_statistics,
    decide,
    privatize,
    random_directions,
    rule_terms,
    sensitivities,
    theorem2_constants,
    theorem3_constants,
)
from dpadapter.federated.mechanisms import make_ledger
from dpadapter.privacy import randomness
from dpadapter.train.strategies import apply_phase

C = RuleConstants(G1_sq=0.4, G2_sq=0.6, Lambda1_sq=0.05, Lambda2_sq=0.08, L=3.0, Gamma=0.2)
SIZES = [120, 300, 80, 500]


def test_noise_of_the_laplace_mechanism_gives_theorem_2():
    T, xi1, eps, beta, p = 30, 10.0, 50.0, 2.0, 6000
    v = aggregated_noise_var("laplace", SIZES, xi1, 2 * T / eps, 1.0)  # nm of Theorem 1
    assert v == pytest.approx(8 * T**2 * xi1**2 / sum(SIZES) ** 2 * len(SIZES) / eps**2)  # Prop. 1
    got = rule_terms(C, T, len(SIZES), beta, p, v)
    want = theorem2_constants(C, T, len(SIZES), beta, p, xi1, sum(SIZES), [eps] * len(SIZES))
    assert got == pytest.approx(want, rel=1e-12)


def test_noise_of_the_paper_gaussian_gives_theorem_3():
    """With sigma_i^2 = c2^2 xi^2 T log(1/delta) / (d_i^2 eps^2) on client i's mean gradient,
    i.e. Opacus multiplier q c2 sqrt(T log(1/delta)) / eps, the general form is Theorem 3."""
    T, xi2, eps, delta, c2, q, beta, p = 40, 1.0, 2.0, 1e-5, 1.3, 0.2, 1.5, 6000
    sigma = q * c2 * math.sqrt(T * math.log(1 / delta)) / eps
    v = aggregated_noise_var("gaussian", SIZES, xi2, sigma, q)
    got = rule_terms(C, T, len(SIZES), beta, p, v)
    n = len(SIZES)
    want = theorem3_constants(C, T, n, beta, p, xi2, sum(SIZES), [eps] * n, [delta] * n, c2)
    assert got == pytest.approx(want, rel=1e-12)


def test_decision_minimises_the_bound():
    little_noise = decide(C, 20, 4, 0.5, 6000, 85, noise_var=1e-9)
    assert little_noise.E1 >= little_noise.E2 and little_noise.t1 == 0
    assert little_noise.predicted_best == "ft"
    much_noise = decide(C, 20, 4, 0.5, 6000, 85, noise_var=1.0)
    assert much_noise.E1 < much_noise.E2 and much_noise.t1 == 20
    assert much_noise.predicted_best == "ht"
    assert much_noise.beta == pytest.approx(0.5 * math.sqrt(20))


@pytest.mark.parametrize(
    ("mechanism", "norm", "stat_clip"), [("gaussian", "l2", None), ("laplace", "l1", 0.01)]
)
def test_released_statistics_respect_their_sensitivities(mechanism, norm, stat_clip):
    """Neighbouring datasets (add one example for Gaussian, replace one for Laplace, d_i
    public) move every released statistic by at most its stated sensitivity, even for an
    extreme example; the clipping bound is small so that clipping is active."""
    model, gsm = make_gsm(0)
    data = make_data(24, 3)
    x, y = data.tensors
    odd = (torch.full((1, 1, 12, 12), 40.0), torch.tensor([4]))
    if mechanism == "gaussian":
        other = TensorDataset(torch.cat([x, odd[0]]), torch.cat([y, odd[1]]))
    else:
        other = TensorDataset(torch.cat([x[:-1], odd[0]]), torch.cat([y[:-1], odd[1]]))
    params = apply_phase(gsm, "ft")
    dirs = random_directions(params, 2, 0.05, seed=0)
    clip, d = 0.5, len(data)
    a = client_statistics(gsm, data, clip, norm, dirs, d_public=d, stat_clip=stat_clip)
    b = client_statistics(gsm, other, clip, norm, dirs, d_public=d, stat_clip=stat_clip)
    sens = sensitivities(mechanism, stat_clip or clip, d, 2)
    va = [a["a_head"], a["s_head"], a["a_full"], a["s_full"], *a["ell"]]
    vb = [b["a_head"], b["s_head"], b["a_full"], b["s_full"], *b["ell"]]
    for u, w, s in zip(va, vb, sens, strict=True):
        assert abs(u - w) <= s * (1 + 1e-6)
    if mechanism == "gaussian":  # adding a clipped example moves s by exactly C^2 / d: tight
        assert abs(va[3] - vb[3]) == pytest.approx(sens[3], rel=1e-3)


def test_privatized_release_is_recorded_with_the_noise_it_adds():
    """The Gaussian release adds sigma_e sqrt(m) * sensitivity times the generator's own
    standard normals and records one q = 1 release; the Laplace one records m releases that
    compose to eps_e."""
    raw = {"a_head": 0.3, "s_head": 0.5, "a_full": 0.4, "s_full": 0.7, "ell": [0.2, 0.1]}
    values = [0.3, 0.5, 0.4, 0.7, 0.2, 0.1]
    sens = sensitivities("gaussian", 1.0, 200, 2)
    ledger = make_ledger("gaussian", 1e-5, "prv")
    noisy = privatize(raw, "gaussian", 1.0, 200, 5.0, torch.Generator().manual_seed(0), ledger)
    z = randomness.standard_normal(6, torch.Generator().manual_seed(0), torch.float64)
    got = [noisy[k] for k in STAT_NAMES] + noisy["ell"]
    want = [
        v + float(zi) * 5.0 * math.sqrt(6) * s for v, zi, s in zip(values, z, sens, strict=True)
    ]
    assert got == want
    assert [(s.noise_multiplier, s.sample_rate, s.steps) for s in ledger.history] == [(5.0, 1, 1)]
    pure = make_ledger("laplace", 0.0, "prv")
    noisy_l = privatize(raw, "laplace", 1.0, 200, 0.5, torch.Generator().manual_seed(0), pure)
    assert [s.steps for s in pure.history] == [6] and pure.epsilon() == pytest.approx(0.5)
    assert noisy_l["ell"] != raw["ell"]
    with pytest.raises(KeyError):
        privatize(raw, "exponential", 1.0, 200, 0.5, torch.Generator(), pure)
    assert pure.steps == 6  # nothing recorded for a refused release


def test_negative_noisy_statistics_are_clamped_and_aggregated():
    """Noise can push a released second moment or smoothness below 0: each is clamped to 0
    before it enters a constant (a negative Lambda^2 or L would flip the rule's decision)."""
    noisy = {"a_head": 0.3, "s_head": -0.5, "a_full": -0.4, "s_full": 0.7, "ell": [-0.2, 0.1]}
    c = client_constants(noisy, 200, 0.2, [0.5, 0.5])
    var = 0.8 / (0.2 * 200)
    assert c == RuleConstants(
        G1_sq=0.3, G2_sq=var * 0.7, Lambda1_sq=0.0, Lambda2_sq=var * 0.7, L=0.1, Gamma=0.0
    )
    full = client_constants(noisy, 200, 1.0, [0.5, 0.5])
    assert full.Lambda1_sq == full.Lambda2_sq == 0.0  # full batch: no sampling variance
    agg = aggregate_constants([c, full], [100, 300])
    assert agg.L == pytest.approx(0.25 * c.L + 0.75 * full.L)
    assert agg.Lambda2_sq == pytest.approx(0.25 * c.Lambda2_sq)
