"""A strategy's phases in every per-sample mode: what a later phase trains has per-example
gradients (UT's switch from the head to every parameter), and a module frozen in the current
phase that the gradient passes through records nothing (BiTFiT: a bias-free conv between
trained biases). Opacus hooks only what is trainable when the model is wrapped; both failed in
hooks and functorch mode before `per_sample.opacus_modes` hooked every module."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from dpadapter.data import build_splits
from dpadapter.models import create_model, replace_head
from dpadapter.per_sample import GRAD_SAMPLE_MODES, wrap_for_dp
from dpadapter.settings import ModelConfig
from dpadapter.train.dp_fit import FitSettings, dp_fit
from dpadapter.train.dp_spec import run_spec
from dpadapter.train.strategies import apply_phase, get_strategy


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_ut_trains_every_parameter_after_t1(tiny_cfg, mode):
    _, roles = build_splits(tiny_cfg, ["syn-same"])
    train = roles["syn-same"].train
    spec = dataclasses.replace(run_spec(tiny_cfg, "dpsgd", 4.0, len(train)), epochs=1)
    model = replace_head(create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0), 5, 0)
    start = copy.deepcopy(model.state_dict())
    schedule = get_strategy("ut").schedule(spec.total_steps, 0.5)
    settings = dataclasses.replace(FitSettings.from_config(tiny_cfg), grad_sample_mode=mode)
    _, ledger = dp_fit(model, train, "dpsgd", spec, settings, 0, schedule=schedule)
    assert ledger.steps == spec.total_steps
    assert all(not torch.equal(v, start[k]) for k, v in model.state_dict().items())


class _BiasFreeConvs(nn.Module):
    """A trained bias, then a bias-free conv the gradient must pass through, then the head."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(1, 4, 3, bias=True)
        self.middle = nn.Conv2d(4, 4, 3, bias=False)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.middle(torch.relu(self.first(x))).flatten(1))

    def get_classifier(self) -> nn.Module:
        return self.head


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_a_frozen_module_inside_the_gradient_path_records_nothing(mode):
    """Wrapped with everything trainable (as the federated stage wraps), then BiTFiT."""
    torch.manual_seed(0)
    model = _BiasFreeConvs()
    clean = copy.deepcopy(model)  # for the reference, without Opacus' hooks
    gsm = wrap_for_dp(model, mode)
    trained = apply_phase(gsm, "bitfit")
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in trained) == ["first.bias", "head.bias", "head.weight"]
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))
    nn.functional.cross_entropy(gsm(x), y).backward()
    for n, p in model.named_parameters():
        got = getattr(p, "grad_sample", None)
        if n in ("first.bias", "head.bias", "head.weight"):
            # per-example gradients (of each example's own loss, Opacus' mean convention)
            assert got is not None and got.shape == (5, *p.shape), n
        else:
            assert got is None, n
    # the reference: each example's own gradient of the first conv's bias
    ref = []
    for i in range(5):
        m = copy.deepcopy(clean)
        nn.functional.cross_entropy(m(x[i : i + 1]), y[i : i + 1]).backward()
        ref.append(m.first.bias.grad)
    torch.testing.assert_close(model.first.bias.grad_sample, torch.stack(ref))
