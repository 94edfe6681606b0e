"""A GroupNorm's input gradient and per-example gradients from one kernel (per_sample.norm_fusion):
the same bits as two kernels, in the same step."""

from __future__ import annotations

import copy

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from test_bookkeeping import CASES, LOSS, _data  # tests/per_sample is on sys.path
from torch import nn

from dpadapter.per_sample import norm_fusion
from dpadapter.per_sample.bookkeeping import BookKeepingModule


class InPlaceAfterNorm(nn.Module):
    """An in-place ReLU on a GroupNorm's output, and a GroupNorm without a bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.gn2 = nn.GroupNorm(2, 8, affine=True)
        self.gn2.bias = None
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu_(self.gn(self.conv(x)))
        return self.head(self.gn2(h).mean(dim=(2, 3)))


FUSION_CASES = {**CASES, "in-place": lambda: (InPlaceAfterNorm(), (2, 6, 6), 3)}


def _step(model, x, y, fused: bool):
    """One recorded batch: the input's gradient, the norms, the clipped sums, and how many
    GroupNorms ran fused."""
    bk = BookKeepingModule(model)
    bk.fuse_norms = fused
    x = x.clone().requires_grad_()  # its gradient passes through every layer's backward
    opt = dp_sgd(bk, 1.0, len(y))
    LOSS(bk(x), y).backward()
    fused_layers = sum(1 for r in bk.records.values() if getattr(r, "per_example", ()))
    norms = bk.per_sample_norms(opt.params)
    sums = bk.clipped_sums(opt.params, norms.clamp(max=1.0))
    return x.grad, norms, [sums[id(p)] for p in opt.params], fused_layers


@pytest.mark.parametrize("case", sorted(FUSION_CASES))
def test_fused_and_separate_kernels_give_the_same_bits(case):
    model, shape, classes = FUSION_CASES[case]()
    x, y = _data(shape, classes)
    x = x.float()
    fused = _step(copy.deepcopy(model), x, y, True)
    apart = _step(copy.deepcopy(model), x, y, False)
    assert apart[3] == 0
    # every GroupNorm with parameters here has an input with a gradient (DP-NAS's have none)
    n_gn = sum(isinstance(m, nn.GroupNorm) and m.weight is not None for m in model.modules())
    assert fused[3] == n_gn, (fused[3], n_gn)
    assert torch.equal(fused[0], apart[0])
    assert torch.equal(fused[1], apart[1])
    for a, b in zip(fused[2], apart[2], strict=True):
        assert torch.equal(a, b)


def test_the_repeated_weights_follow_the_batch_size_and_the_weights():
    gns = [nn.GroupNorm(2, 4), nn.GroupNorm(3, 6)]
    for m in gns:
        nn.init.normal_(m.weight)
    weights = norm_fusion.RepeatedWeights(gns)
    for n in (5, 3, 7, 2):
        weights.clear()
        for m in gns:
            assert torch.equal(weights.of(m, n), m.weight.detach().repeat(n))
    weights.clear()
    weights.of(gns[0], 4)
    with torch.no_grad():
        gns[1].weight.add_(1.0)  # an optimizer step between two forwards, without a `clear`
    assert torch.equal(weights.of(gns[1], 4), gns[1].weight.detach().repeat(4))
    gns[0].weight = nn.Parameter(torch.ones(4))  # a new tensor
    assert torch.equal(weights.of(gns[0], 4), torch.ones(16))


def test_where_the_kernels_stay_apart():
    gn = nn.GroupNorm(2, 4)
    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    out, mean, rstd = torch.ops.aten.native_group_norm(x, gn.weight, gn.bias, 3, 4, 25, 2, 1e-5)
    saved = (mean, rstd)
    assert norm_fusion.fusable(gn, x, out, saved)
    assert not norm_fusion.fusable(gn, x.detach(), out, saved)  # the first layer: no dx
    assert not norm_fusion.fusable(gn, x, out, ())  # the forward's statistics were not kept
    cl = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    assert not norm_fusion.fusable(gn, cl, out, saved)  # folding would copy it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not norm_fusion.fusable(gn, x, out, saved)
    assert not norm_fusion.fusable(nn.GroupNorm(2, 4, affine=False), x, out, saved)
    # a bf16 layer: its per-example gradients are taken from fp32 copies in the norms phase
    low = gn.to(torch.bfloat16)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    yb, mb, rb = torch.ops.aten.native_group_norm(xb, low.weight, low.bias, 3, 4, 25, 2, 1e-5)
    assert not norm_fusion.fusable(low, xb, yb, (mb, rb))
