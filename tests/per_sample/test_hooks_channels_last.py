"""Opacus' hooks mode and permuted (channels-last) Conv2d inputs: the bug, the guard, Table 2.

The first test is the guard's reason, kept as a check that fails once Opacus is fixed (then the
guard in `opacus_modes` may go): raw Opacus' hooks-mode per-example gradient of a conv fed a
channels-last input is far from the per-example loop's.
"""

from __future__ import annotations

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from opacus.grad_sample import GradSampleModule
from torch import nn

from dpadapter.models import create_model
from dpadapter.per_sample import wrap_for_dp
from dpadapter.per_sample.opacus_modes import permuted_layout
from dpadapter.settings import load

LOSS = nn.functional.cross_entropy


def _one_conv(padding: int = 1) -> nn.Module:
    torch.manual_seed(0)
    side = 8 + 2 * padding - 2
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=padding), nn.Flatten(), nn.Linear(4 * side * side, 2)
    )


def _per_example_conv_grads(model: nn.Module, x, y) -> torch.Tensor:
    out = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        LOSS(model(x[i : i + 1].contiguous()), y[i : i + 1]).backward()
        out.append(model[0].weight.grad.clone())
    return torch.stack(out)


LAYOUTS = {
    "channels-last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "hw-transposed": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3),
}


@pytest.mark.parametrize(
    ("layout", "padding"), [("channels-last", 0), ("channels-last", 1), ("hw-transposed", 0)]
)
def test_raw_opacus_hooks_mode_is_wrong_on_permuted_conv_inputs(layout, padding):
    """(H/W transposed with padding is right: F.pad then copies to row-major; refused anyway.)"""
    model = _one_conv(padding).double()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1, 0])
    ref = _per_example_conv_grads(model, x, y)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    LOSS(gsm(x), y, reduction="sum").backward()  # row-major: right
    right = float((model[0].weight.grad_sample - ref).norm() / ref.norm())
    gsm.zero_grad(set_to_none=True)
    xp = LAYOUTS[layout](x)
    assert torch.equal(xp, x) and permuted_layout(xp)
    LOSS(gsm(xp), y, reduction="sum").backward()  # same values, permuted strides: wrong
    wrong = float((model[0].weight.grad_sample - ref).norm() / ref.norm())
    gsm._close()
    assert right < 1e-12
    assert wrong > 0.5, f"Opacus got it right ({wrong:.3g}): the guard may be dropped"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hooks_mode_refuses_a_permuted_conv_input_naming_the_conv(layout):
    model = _one_conv()
    wrapped = wrap_for_dp(model, "hooks")
    x = torch.randn(4, 3, 8, 8)
    LOSS(wrapped(x), torch.tensor([0, 1, 1, 0])).backward()  # row-major passes
    with pytest.raises(RuntimeError, match=r"Conv2d '0' has strides .* ew or functorch"):
        wrapped(LAYOUTS[layout](x))
    with torch.no_grad():  # evaluation computes no per-example gradients
        wrapped(LAYOUTS[layout](x))
    model[0].requires_grad_(False)  # a frozen conv has no per-example gradient to get wrong
    wrapped(LAYOUTS[layout](x))
    model[0].requires_grad_(True)
    wrapped._close()
    model(LAYOUTS[layout](x))  # the plain model is left without the guard


def test_sliced_inputs_pass_and_are_right():
    """A non-dense (sliced) input is copied by F.pad inside Opacus and comes out right."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).double()
    x = torch.randn(4, 3, 8, 16, dtype=torch.float64)[..., ::2]
    y = torch.tensor([0, 1, 1, 0])
    assert not x.is_contiguous() and not permuted_layout(x)
    ref = _per_example_conv_grads(model, x, y)
    wrapped = wrap_for_dp(model, "hooks")
    LOSS(wrapped(x), y).backward()  # loss_reduction 'mean' in wrap_for_dp, as in training
    got = model[0].weight.grad_sample
    assert float((got - ref).norm() / ref.norm()) < 1e-12


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("path", ["configs/dpsat-table2.yaml", "configs/dpsat-table2-dpnas.yaml"])
def test_table2_models_train_a_hooks_step_without_tripping_the_guard(path):
    cfg = load(path)
    assert cfg.finetune.grad_sample_mode == "hooks"
    assert {t.dataset for t in cfg.tasks.values()} == {"fashion-mnist"}  # 1 x 28 x 28, 10 classes
    model = create_model(cfg.model, 10, 1, seed=0)
    wrapped = wrap_for_dp(model, "hooks")
    opt = dp_sgd(wrapped, 1.0, 3, lr=0.1, noise=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 1, 28, 28)
    LOSS(wrapped(x), torch.tensor([0, 5, 9])).backward()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(m.weight.grad_sample.shape[0] == 3 for m in convs)
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    wrapped._close()


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_timm_convnext_under_hooks_is_refused_where_layernorm2d_feeds_a_conv():
    """The issue's silent error (hooks' clipped sum off by 1.45 on ConvNeXt) is now an error."""
    import timm

    model = timm.create_model("convnext_atto", num_classes=5)
    wrapped = wrap_for_dp(model, "hooks")
    with pytest.raises(RuntimeError, match=r"Conv2d 'stages\.\d\.(downsample|blocks)"):
        wrapped(torch.randn(2, 3, 32, 32))
    wrapped._close()
