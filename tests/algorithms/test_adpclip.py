"""AdpClip: quantile-tracking clip; the ledger records the joint sigma of gradient and count."""

from __future__ import annotations

import math

import algo_harness as H
import pytest
import torch

from dpadapter.algorithms import ALGORITHMS
from dpadapter.algorithms.adpclip import gradient_noise_multiplier
from dpadapter.privacy import Segment, epsilon_from_history


def _per_example_norms(x, y) -> torch.Tensor:
    model = H.tiny_model()
    norms = []
    for i in range(len(y)):
        model.zero_grad()
        H.LOSS(model(x[i : i + 1]), y[i : i + 1]).backward()
        norms.append(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))
    return torch.stack(norms)


def test_ledger_records_the_joint_sigma_not_the_inflated_gradient_multiplier(algo_data):
    s = H.spec(
        max_grad_norm=0.5, expected_batch_size=12, accountant="rdp", params={"count_noise": 1.0}
    )
    run = H.build("adpclip", s)
    x, y = algo_data.private.tensors
    for t in range(3):
        H.logical_step(run, x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12])
    sigma = run.algo.sigma
    (seg,) = run.ledger.history
    assert seg.noise_multiplier == sigma
    grad, count = run.algo.audit[0].releases
    inflated = gradient_noise_multiplier(sigma, 1.0)
    assert grad.noise_std == pytest.approx(inflated * 0.5) and inflated > sigma
    assert (count.sensitivity, count.noise_std) == (0.5, 1.0)
    assert (1 / inflated) ** 2 + (0.5 / 1.0) ** 2 == pytest.approx(sigma**-2)
    # recording the inflated multiplier (Opacus <= 1.5.4) would under-report epsilon
    hist = [Segment(inflated, seg.sample_rate, 1000)]
    assert epsilon_from_history(hist, 1e-5, "rdp") < epsilon_from_history(
        [Segment(sigma, seg.sample_rate, 1000)], 1e-5, "rdp"
    )
    assert ALGORITHMS["adpclip"].mechanism_note


def test_sigma_must_be_below_twice_the_count_noise():
    with pytest.raises(ValueError, match="2 \\* count_noise"):
        H.build("adpclip", H.spec(params={"count_noise": 0.4}), sigma=0.9)


def test_clip_update_uses_the_centred_count_over_the_expected_batch_size(algo_data):
    n, m, lr, target = 10, 16, 0.2, 0.5
    x, y = algo_data.private.tensors
    norms = _per_example_norms(x[:n], y[:n])
    c0 = float(norms.quantile(0.3))
    s = H.spec(max_grad_norm=c0, expected_batch_size=m, params={"count_noise": 1e-9})
    run = H.build("adpclip", s, sigma=0.0)
    H.logical_step(run, x[:n], y[:n], physical=3)
    unclipped = int((norms <= c0).sum())
    assert 0 < unclipped < n
    frac = (unclipped - n / 2) / m + 0.5  # Opacus would use unclipped / n
    assert run.algo.clip == pytest.approx(c0 * math.exp(-lr * (frac - target)), rel=1e-6)


def test_clip_tracks_the_target_quantile(algo_data):
    n = 24
    s = H.spec(max_grad_norm=1.0, expected_batch_size=n, params={"count_noise": 1.0})
    run = H.build("adpclip", s, sigma=0.1, lr=0.0)
    x, y = algo_data.private.tensors
    logs = []
    for _ in range(60):
        H.logical_step(run, x[:n], y[:n])
        logs.append(math.log(run.algo.clip))
    clip = math.exp(sum(logs[-20:]) / 20)  # it oscillates around the quantile
    frac = float((_per_example_norms(x[:n], y[:n]) <= clip).float().mean())
    assert 0.3 <= frac <= 0.7, (clip, frac)
