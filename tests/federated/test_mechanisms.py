"""Client-side mechanisms: Laplace scale (Theorem 1), l1 clipping, and per-client accountants."""

import pytest
import torch
from fed_helpers import make_data, make_gsm

from dpadapter.federated.mechanisms import (
    LaplaceDPOptimizer,
    gaussian_sigma,
    laplace_noise_multiplier,
    pure_dp_delta,
    theorem1_scale,
)
from dpadapter.federated.simulation import Client, Federation, MechanismRun
from dpadapter.federated.stage import estimate_sigma
from dpadapter.privacy import Segment, epsilon_from_history, pld_epsilon
from dpadapter.train.strategies import get_strategy


def test_laplace_noise_scale_matches_theorem_1():
    rounds, xi1, eps = 6, 2.0, 3.0
    data = make_data(40)
    model, gsm = make_gsm(0)
    nm = laplace_noise_multiplier(eps, rounds)
    mech = MechanismRun("laplace", xi1, nm, 1.0, lr=0.01)
    client = Client(0, data, mech, seed=0)
    client.audit = []
    Federation(gsm, [client], get_strategy("ft").schedule(rounds)).run()
    b = theorem1_scale(rounds, xi1, len(data), eps)
    assert b == pytest.approx(2 * rounds * xi1 / (len(data) * eps))
    assert mech.noise_multiplier * xi1 / len(data) == pytest.approx(b)  # scale on the mean
    noise = torch.cat([a["noise"] for a in client.audit]) / len(data)  # noise on the mean
    assert noise.numel() > 5000
    assert noise.abs().mean().item() == pytest.approx(b, rel=0.05)  # E|Lap(b)| = b
    assert noise.pow(2).mean().item() == pytest.approx(2 * b * b, rel=0.1)  # Var = 2 b^2
    # Laplace, not Gaussian: (E|X|)^2 / E[X^2] is 1/2 (Gaussian: 2/pi = 0.64)
    ratio = noise.abs().mean().item() ** 2 / noise.pow(2).mean().item()
    assert 0.46 < ratio < 0.55
    # the ledger: K releases of (2 / nm)-DP each, composed to exactly eps; PLD agrees (delta 0)
    assert client.ledger.steps == rounds
    assert client.ledger.epsilon() == pytest.approx(eps, rel=1e-12)
    assert pure_dp_delta(client.ledger.history, eps) < 1e-9
    assert pure_dp_delta(client.ledger.history, 0.5 * eps) > 1e-6


def test_laplace_optimizer_clips_each_example_in_l1():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    opt = LaplaceDPOptimizer(
        torch.optim.SGD([p], lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=2.0,
        expected_batch_size=3,
        loss_reduction="mean",
    )
    g = torch.tensor([[[1.0] * 4] * 3, [[0.01] * 4] * 3, [[-5.0] * 4] * 3])  # l1: 12, 0.12, 60
    p.grad_sample = g
    opt.clip_and_accumulate()
    expected = g[0] * (2.0 / 12) + g[1] + g[2] * (2.0 / 60)
    assert torch.allclose(p.summed_grad, expected, atol=1e-5)
    for row in (g[0] * 2 / 12, g[2] * 2 / 60):
        assert row.abs().sum().item() == pytest.approx(2.0, rel=1e-5)


def test_each_gaussian_clients_epsilon_is_an_independent_recomputation():
    """Clients of different sizes, one accountant each, kept across all rounds (never reset):
    the ledger's epsilon equals dp-accounting's PLD on the schedule the client should have."""
    rounds, q, delta, target = 4, 0.5, 1e-5, 2.0
    sigma = 2.4  # what the PRV calibration gives for this target (not re-run here: slow)
    model, gsm = make_gsm(0)
    mech = MechanismRun("gaussian", 1.0, sigma, q, lr=0.1, delta=delta, accountant="prv")
    clients = [Client(i, make_data(n, i), mech, seed=0) for i, n in enumerate((20, 35, 50))]
    Federation(gsm, clients, get_strategy("ft").schedule(rounds), local_steps=1).run()
    independent = pld_epsilon([Segment(sigma, q, rounds)], delta)
    one_round = pld_epsilon([Segment(sigma, q, 1)], delta)
    assert independent > 1.3 * one_round  # what a per-round reset would report instead
    for c in clients:
        assert c.ledger.steps == rounds
        assert [s.as_tuple() for s in c.ledger.history] == [(sigma, q, rounds)]
        eps = c.ledger.epsilon()
        assert independent <= eps <= 1.02 * independent
        assert eps <= target * 1.001


def test_joint_calibration_covers_the_estimation_release():
    delta, q, steps, target = 1e-5, 0.2, 10, 1.0
    sigma_e = estimate_sigma(0.1, delta)
    assert pld_epsilon([Segment(sigma_e, 1.0, 1)], delta) == pytest.approx(0.1, abs=2e-3)
    prior = [Segment(sigma_e, 1.0, 1)]
    alone = gaussian_sigma(target, delta, q, steps, "rdp")
    joint = gaussian_sigma(target, delta, q, steps, "rdp", prior)
    assert joint > alone
    hist = [*prior, Segment(joint, q, steps)]
    assert epsilon_from_history(hist, delta, "rdp") <= target
    assert (
        epsilon_from_history([*prior, Segment(0.99 * joint, q, steps)], delta, "rdp")
        > target * 0.999
    )
