"""DP-SAM: two privatized gradients per step on the same batch, accounted jointly."""

from __future__ import annotations

import math

import algo_harness as H
import pytest

from dpadapter.algorithms import ALGORITHMS
from dpadapter.privacy import Segment, epsilon_from_history


def test_equal_epsilon_means_sqrt2_more_noise_per_gradient_and_dpsgd_ledger(algo_data):
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12, accountant="rdp")
    x, y = algo_data.private.tensors
    sam, sgd = H.build("dpsam", s), H.build("dpsgd", s)
    for run in (sam, sgd):
        for t in range(2):
            H.logical_step(run, x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12], physical=5)
    sigma = sgd.algo.sigma
    assert sam.opt.noise_multiplier == math.sqrt(2) * sigma
    assert [r.name for r in sam.algo.audit[0].releases] == ["ascent", "gradient"]
    assert all(r.noise_std == sam.opt.noise_multiplier * 0.5 for r in sam.algo.audit[0].releases)
    # the ledger holds one joint release per step, at DP-SGD's calibrated sigma
    assert sam.ledger.steps == sgd.ledger.steps == 2
    (seg,) = sam.ledger.history
    assert seg.noise_multiplier == pytest.approx(sigma, rel=1e-12)
    assert ALGORITHMS["dpsam"].mechanism_note


def test_joint_accounting_is_the_conservative_one():
    """Two subsampled releases with independent batches (what 'two steps' would record) spend
    less than the two queries on one batch actually do, so they would under-report."""
    q, steps, sigma_each, delta = 0.02, 2000, 2.0, 1e-5
    joint = epsilon_from_history([Segment(sigma_each / math.sqrt(2), q, steps)], delta, "rdp")
    independent = epsilon_from_history([Segment(sigma_each, q, 2 * steps)], delta, "rdp")
    assert joint > 1.05 * independent
