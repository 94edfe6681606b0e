"""The independence check by behaviour, wider (issue 45, item 3): each gap a review found in
the old check gets a planted module that passed it and is now refused by name, with the
per-sample self-test on and off; and what does not learn from the data still passes.

The old check changed one example (the third) at one batch size (6), compared forward outputs
only, and watched registered buffers only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpadapter.per_sample import MixedExamplesError, wrap_for_dp
from dpadapter.per_sample.independence import batch_sizes, positions

SAMPLE = ((1, 6, 6), torch.float32)


class ReferenceMix(nn.Module):
    """Every example minus the first: mixes only through example 1."""

    def forward(self, x):
        return x - x[:1]


class OddBatchMix(nn.Module):
    """Subtracts the batch mean, but only when the batch size is odd."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if x.shape[0] % 2 else x


class _CentreGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


class BackwardMix(nn.Module):
    """The identity forward, a backward that centres the gradients over the batch."""

    def forward(self, x):
        return _CentreGradients.apply(x)


class KeepsInputMean(nn.Module):
    """Per-example output, but keeps the inputs' mean in a plain attribute (no buffer)."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def forward(self, x):
        self.seen = x.detach().mean(0)
        return x


class CountsInputs(nn.Module):
    """Per-example output; adds the inputs' sum into a tensor attribute made at init."""

    def __init__(self):
        super().__init__()
        self.total = torch.zeros(())

    def forward(self, x):
        self.total += x.detach().sum()
        return x


class ShapeCache(nn.Module):
    """Caches what the input's shape alone determines: not learning from the data."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        key = tuple(x.shape[1:])
        if key not in self.cache:
            self.cache[key] = torch.linspace(0, 1, x.shape[-1])
        return x * (1 + self.cache[key])


GAPS = [ReferenceMix, OddBatchMix, BackwardMix, KeepsInputMean, CountsInputs]


def _net(middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), middle, nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


@pytest.mark.parametrize("check", [True, False], ids=["self-test", "no-self-test"])
@pytest.mark.parametrize("cls", GAPS, ids=lambda c: c.__name__)
def test_each_gap_is_refused_by_name_before_any_step(cls, check):
    with pytest.raises(MixedExamplesError, match=rf"'1' \({cls.__name__}\)"):
        wrap_for_dp(_net(cls()), "bk", sample=SAMPLE, check=check)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_the_other_modes_refuse_them_too(mode):
    for cls in GAPS:
        with pytest.raises(MixedExamplesError, match=cls.__name__):
            wrap_for_dp(_net(cls()), mode, sample=SAMPLE, check=False)


def test_a_mixing_module_inside_a_frozen_block_is_refused_through_the_gradient():
    """A backward that mixes under a frozen layer still moves the trained layer's gradients."""
    model = _net(BackwardMix())
    for p in model[0].parameters():
        p.requires_grad_(False)
    with pytest.raises(MixedExamplesError, match="backward pass mixes examples"):
        wrap_for_dp(model, "bk", sample=SAMPLE, check=False)


def test_a_shape_cache_passes_and_the_model_is_left_as_it_was():
    cached = ShapeCache()
    model = _net(cached)
    wrapped = wrap_for_dp(model, "bk", sample=SAMPLE, check=False)
    assert wrapped.independence.frozen == ()
    assert wrapped.independence.batch_sizes == (6, 5)
    assert cached.cache == {}  # what the check's calls added is gone
    assert wrap_for_dp(_net(ShapeCache()), "bk", sample=SAMPLE).per_sample_check["passed"]
    counting = CountsInputs()
    with pytest.raises(MixedExamplesError):
        wrap_for_dp(_net(counting), "bk", sample=SAMPLE, check=False)
    assert torch.equal(counting.total, torch.zeros(()))  # restored after the refusal


def test_positions_and_sizes():
    assert positions(6) == (0, 2, 5) and positions(5) == (0, 2, 4)
    assert batch_sizes(6) == (6, 5) and batch_sizes(7) == (7, 8)
