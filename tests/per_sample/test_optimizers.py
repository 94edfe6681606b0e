"""The DP optimizer's clip is chosen when it is built (`optimizers.optimizer_class`, as
Opacus' `get_optimizer_class`), never by swapping the class of a live optimizer."""

from __future__ import annotations

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from opacus.optimizers import DPOptimizer
from opacus.optimizers import optimizer as opacus_optimizer
from torch import nn

from dpadapter.algorithms.adpclip import CentredAdaClipOptimizer
from dpadapter.algorithms.gep import GEPOptimizer
from dpadapter.per_sample import optimizer_class, wrap_for_dp
from dpadapter.per_sample.optimizers import BookKeepingClip, FP32Clip
from dpadapter.per_sample.rules import RULES, SUPPORTED_LAYERS, closed_form


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("mode, clip", [("bk", BookKeepingClip), ("ew", FP32Clip)])
@pytest.mark.parametrize("base", [DPOptimizer, CentredAdaClipOptimizer, GEPOptimizer])
def test_the_class_is_the_algorithms_behind_the_modes_clip(mode, clip, base):
    wrapped = wrap_for_dp(_model(), mode)
    cls = optimizer_class(base, wrapped)
    assert issubclass(cls, base) and issubclass(cls, clip)
    assert cls.__mro__[1] is clip  # the mode's clip_and_accumulate comes first
    assert optimizer_class(base, wrapped) is cls  # made once per pair
    with pytest.raises(TypeError, match="already has its clip"):
        optimizer_class(cls, wrapped)


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_built_optimizer_keeps_its_class_through_a_step(mode):
    wrapped = wrap_for_dp(_model(), mode)
    opt = dp_sgd(wrapped, 0.1, 4, lr=0.1)
    cls = type(opt)
    assert cls is optimizer_class(DPOptimizer, wrapped)
    assert "clip_and_accumulate" not in vars(opt)  # no method bound on the instance
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    nn.functional.cross_entropy(wrapped(x), y).backward()
    opt.step()
    assert type(opt) is cls
    assert all(p.grad is not None for p in wrapped.parameters())


def test_the_rules_table_covers_the_supported_layers():
    assert SUPPORTED_LAYERS == tuple(RULES) == (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm)
    assert all(callable(r.norms_sq) and callable(r.clipped_sum) for r in RULES.values())

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    assert closed_form(nn.Linear(2, 2)) and not closed_form(OwnForward(2, 2))
    assert not closed_form(nn.Conv2d(1, 1, 3, padding="same"))
    assert not closed_form(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"))


@pytest.mark.parametrize("secret", [False, True])
@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_the_fused_release_is_opacus_release_with_one_flat_draw(mode, secret):
    """Issue 47: the noise and scaling phases in one `torch._foreach` call each (`FusedRelease`)
    give Opacus' release to the bit when Opacus' per-tensor draws are replaced by one flat draw
    from the same generator cut into the tensors (`flat_noise`): the same sums and divisions,
    the noise from the run's generator. A secret generator still draws from the OS (one release
    then differs from another, as it must)."""
    from dpadapter.per_sample import optimizers
    from dpadapter.per_sample.optimizers import FusedRelease
    from dpadapter.privacy import randomness

    randomness.install()
    grads = {}
    for fused in (True, False):
        wrapped = wrap_for_dp(_model(), mode)
        opt = dp_sgd(wrapped, 1.0, 3, lr=0.1, noise=1.0)  # 3: no exact reciprocal
        if secret:
            opt.generator = randomness.secret_generator()
        else:
            opt.generator = torch.Generator().manual_seed(7)
        assert isinstance(opt, FusedRelease)
        if not fused:  # Opacus' own phases on the same optimizer, fed the flat draw's pieces

            def opacus_release(o=opt):
                pieces = iter(
                    optimizers.flat_noise(
                        o.noise_multiplier * o.max_grad_norm,
                        [p.summed_grad for p in o.params],
                        o.generator,
                        o.secure_mode,
                    )
                )
                real = opacus_optimizer._generate_noise
                opacus_optimizer._generate_noise = lambda **k: next(pieces)
                try:
                    DPOptimizer.add_noise(o)
                finally:
                    opacus_optimizer._generate_noise = real
                assert next(pieces, None) is None  # one piece per tensor, all used

            opt.add_noise = opacus_release
            opt.scale_grad = lambda o=opt: DPOptimizer.scale_grad(o)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.pre_step()
        grads[fused] = [p.grad.clone() for p in wrapped.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
    assert same is not secret
    assert all(g.abs().sum() > 0 for g in grads[True])  # noise was drawn (sigma 1)


def test_flat_noise_is_one_draw_cut_into_the_tensors():
    """One draw per dtype and device, in the tensors' order: the pieces are the flat draw's
    consecutive slices, shaped like each tensor, each group from its own draw."""
    from dpadapter.per_sample.optimizers import flat_noise

    like = [torch.zeros(3, 2), torch.zeros(5, dtype=torch.float64), torch.zeros(4)]
    got = flat_noise(2.0, like, torch.Generator().manual_seed(3), False)
    g = torch.Generator().manual_seed(3)
    f32 = torch.normal(0.0, 2.0, (10,), generator=g)
    f64 = torch.normal(0.0, 2.0, (5,), generator=g, dtype=torch.float64)
    assert [t.shape for t in got] == [t.shape for t in like]
    assert [t.dtype for t in got] == [t.dtype for t in like]
    assert torch.equal(got[0].flatten(), f32[:6]) and torch.equal(got[2], f32[6:])
    assert torch.equal(got[1], f64)
