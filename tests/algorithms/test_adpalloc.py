"""AdpAlloc: exponentially decaying sigma, calibrated on the planned heterogeneous history."""

from __future__ import annotations

import math

import algo_harness as H
import pytest

from dpadapter.algorithms.adpalloc import calibrate_decay, planned_history
from dpadapter.privacy import calibrate_sigma, epsilon_from_history


def test_sigma0_meets_the_target_tightly_on_the_planned_history():
    decay, steps_per_epoch, epochs = 0.3, 10, 2
    eps, delta, q = 4.0, 1e-5, 0.1  # 20 steps, as H.spec: the constant calibration is shared
    constant = calibrate_sigma(eps, delta, q, steps_per_epoch * epochs, "rdp", H.CALIBRATION_CACHE)
    s0 = calibrate_decay(eps, delta, q, steps_per_epoch, epochs, decay, "rdp", constant)
    plan = planned_history(s0, decay, q, steps_per_epoch, epochs)
    spent = epsilon_from_history(plan, delta, "rdp")
    assert 0.99 * eps <= spent <= eps
    assert s0 > constant  # later, quieter epochs are paid for by a louder start
    assert plan[-1].noise_multiplier < constant


def test_run_records_the_planned_schedule(algo_data):
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12, params={"decay": 0.2})
    run = H.build("adpalloc", s)
    x, y = algo_data.private.tensors
    for epoch in range(s.epochs):
        run.algo.start_epoch(epoch)
        for t in range(s.steps_per_epoch):
            if t < 2:
                H.logical_step(run, x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12], physical=5)
            else:
                H.empty_step(run)
    assert run.ledger.history == run.algo.planned_history()
    sig = [seg.noise_multiplier for seg in run.ledger.history]
    assert sig[1] == pytest.approx(sig[0] * math.exp(-0.2))
    assert run.ledger.epsilon() <= s.target_epsilon


def test_zero_decay_is_constant_sigma():
    s = H.spec(accountant="rdp", params={"decay": 0.0})
    run = H.build("adpalloc", s)
    assert run.algo.sigma == calibrate_sigma(4.0, 1e-5, 0.1, 20, "rdp", H.CALIBRATION_CACHE)
