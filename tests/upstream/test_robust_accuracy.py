"""Robust accuracy (paper Section 2.3) as the upstream comparison uses it."""

from __future__ import annotations

import pytest
import torch
from upstream_helpers import indexed_data, params_of, small_model

from dpadapter.train.loops import evaluate, robust_accuracy


def _trained_ish_model():
    """A model whose accuracy is not at chance, so that noise has something to destroy."""
    data = indexed_data(300)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data.tensors
    x = x.clone()
    x[:, 0, 0, 0] = 0.0  # the index pixel would only be noise to learn from
    data = torch.utils.data.TensorDataset(x, y)
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, data


def test_zero_noise_equals_accuracy():
    model, data = _trained_ish_model()
    acc = evaluate(model, data)
    assert robust_accuracy(model, data, noise_std=0.0, draws=3, seed=0) == acc
    # A vanishing but non-zero scale goes through the noisy path and must agree too.
    assert robust_accuracy(model, data, noise_std=1e-9, draws=2, seed=0) == pytest.approx(acc)


def test_noise_is_seeded_and_weights_are_restored():
    model, data = _trained_ish_model()
    before = params_of(model)
    acc = evaluate(model, data)
    a = robust_accuracy(model, data, noise_std=0.5, draws=3, seed=5)
    b = robust_accuracy(model, data, noise_std=0.5, draws=3, seed=5)
    assert a == b
    assert a < acc  # heavy weight noise costs accuracy, so the measure can tell models apart
    assert all(torch.equal(p, q) for p, q in zip(params_of(model), before, strict=True))
