"""DP-SAT: the ascent is along the previous privatized gradient and costs no privacy."""

from __future__ import annotations

import algo_harness as H
import pytest
import torch

from dpadapter.algorithms import ALGORITHMS
from dpadapter.algorithms.base import global_norm


def _released(step, batch: int) -> list[torch.Tensor]:
    """The privatized gradient the base optimizer received, from the audit (flattened)."""
    (r,) = step.releases
    return (r.signal + r.noise) / batch


def test_gradient_is_taken_at_the_weights_perturbed_along_the_previous_release(algo_data):
    n = 12
    s = H.spec(max_grad_norm=1e6, expected_batch_size=n)
    x, y = algo_data.private.tensors
    sat = H.build("dpsat", s, sigma=0.0, lr=0.0)
    sgd = H.build("dpsgd", s, sigma=0.0, lr=0.0)
    for run in (sat, sgd):
        H.logical_step(run, x[:n], y[:n])
        H.logical_step(run, x[n : 2 * n], y[n : 2 * n], physical=5)
    d = _released(sat.algo.audit[0], n)
    # by hand: gradient of the second batch at w + rho d / ||d|| (lr 0: w never moved)
    plain = H.tiny_model()
    rho = sat.algo.params["rho"]
    with torch.no_grad():
        offset = 0
        for p in plain.parameters():
            p.add_(d[offset : offset + p.numel()].view_as(p), alpha=rho / float(d.norm()))
            offset += p.numel()
    H.LOSS(plain(x[n : 2 * n]), y[n : 2 * n]).backward()
    by_hand = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]) * n
    sat_signal = sat.algo.audit[1].releases[0].signal
    sgd_signal = sgd.algo.audit[1].releases[0].signal
    assert torch.allclose(sat_signal, by_hand, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(sat_signal, sgd_signal, atol=1e-3), "no ascent happened"


def test_ascent_direction_is_the_noisy_release_not_the_clean_gradient(algo_data):
    n = 12
    run = H.build("dpsat", H.spec(max_grad_norm=0.5, expected_batch_size=n), sigma=1.0)
    x, y = algo_data.private.tensors
    H.logical_step(run, x[:n], y[:n])
    direction = torch.cat([d.reshape(-1) for d in run.algo._direction])
    (r,) = run.algo.audit[0].releases
    assert torch.allclose(direction, (r.signal + r.noise) / n, atol=1e-6)
    assert not torch.allclose(direction, r.signal / n, atol=1e-3)


def test_momentum_variant_ascends_along_the_momentum_of_releases(algo_data):
    n, beta = 12, 0.7
    s = H.spec(max_grad_norm=0.5, expected_batch_size=n, params={"beta": beta})
    run = H.build("dpsat-momentum", s, sigma=1.0, lr=0.1)
    x, y = algo_data.private.tensors
    for t in range(3):
        H.logical_step(run, x[n * t : n * t + n], y[n * t : n * t + n], physical=5)
    g = [_released(step, n) for step in run.algo.audit]
    expected = beta * (beta * g[0] + g[1]) + g[2]
    direction = torch.cat([d.reshape(-1) for d in run.algo._direction])
    assert torch.allclose(direction, expected, atol=1e-5)
    # beta None follows the base optimizer's momentum (Appendix G.1)
    run2 = H.build("dpsat-momentum", H.spec(), sigma=1.0, momentum=0.9)
    assert run2.algo._beta() == 0.9


@pytest.mark.parametrize("name", ["dpsat", "dpsat-momentum"])
def test_costs_exactly_what_dpsgd_costs(name, algo_data):
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12, accountant="rdp")
    x, y = algo_data.private.tensors
    runs = [H.build(a, s) for a in (name, "dpsgd")]
    for run in runs:
        for t in range(3):
            H.logical_step(run, x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12])
        H.empty_step(run)
    assert runs[0].ledger.history == runs[1].ledger.history
    assert runs[0].algo.sigma == runs[1].algo.sigma
    assert ALGORITHMS[name].mechanism_note is None  # literally DP-SGD's mechanism


def test_zero_rho_is_dpsgd(algo_data):
    n = 12
    x, y = algo_data.private.tensors
    plain = H.spec(max_grad_norm=0.5, expected_batch_size=n)
    sat = H.build("dpsat", H.with_spec(plain, params={"rho": 0.0}), sigma=0.5, lr=0.2)
    sgd = H.build("dpsgd", plain, sigma=0.5, lr=0.2)
    for run in (sat, sgd):
        for t in range(2):
            H.logical_step(run, x[n * t : n * t + n], y[n * t : n * t + n])
    for a, b in zip(sat.params, sgd.params, strict=True):
        assert torch.equal(a, b)
    assert float(global_norm(sat.algo._direction)) > 0
