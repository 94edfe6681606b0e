"""The CPU max-pool fast path gives torch's numbers: outputs and gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpadapter.models.factory import MODEL_NAMES
from dpadapter.models.pooling import MaxPool2d

# (kernel, stride, padding, dilation, ceil_mode): the models' own (2 and 3/1/1) and odd ones
CASES = [
    (2, None, 0, 1, False),
    (3, 1, 1, 1, False),
    (3, 2, 1, 1, True),
    ((2, 3), (1, 2), (1, 0), (2, 1), False),
]


def _inputs(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(5, 8, 15, 13, generator=g, dtype=dtype)
    # many ties: which element of a tied window gets the gradient is the point
    ties = torch.randint(0, 3, (4, 3, 12, 10), generator=g).to(dtype)
    relu = plain.relu()  # ties at zero, as after the models' ReLU
    nan = plain.clone()
    nan[0, 0, 3, 4] = float("nan")
    nan[1, 2, 0, 0] = float("nan")
    return [plain, ties, relu, nan]


def _both(x: torch.Tensor, module: nn.Module, grad_seed: int):
    x = x.clone().requires_grad_()
    y = module(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=y.dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    return y.detach(), gx


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_and_gradients_are_torchs_bit_for_bit(case, dtype):
    k, s, p, d, ceil = case
    ours, theirs = MaxPool2d(k, s, p, d, ceil_mode=ceil), nn.MaxPool2d(k, s, p, d, ceil_mode=ceil)
    for i, x in enumerate(_inputs(len(str(case)), dtype)):
        y1, g1 = _both(x, ours, i)
        y2, g2 = _both(x, theirs, i)
        assert torch.equal(y1.nan_to_num(7.0), y2.nan_to_num(7.0)), (case, i)
        assert torch.equal(g1.nan_to_num(7.0), g2.nan_to_num(7.0)), (case, i)
        # the layers below get the layout torch's own module gives them
        assert g1.is_contiguous() and y1.is_contiguous()


def test_it_takes_the_fast_path_on_the_cpu(monkeypatch):
    """A test of the equality above is empty if the fast path never runs: count its calls."""
    from dpadapter.models import pooling

    calls = []
    real = pooling._ChannelsLastMaxPool.apply
    monkeypatch.setattr(
        pooling._ChannelsLastMaxPool, "apply", lambda *a: calls.append(1) or real(*a)
    )
    MaxPool2d(2)(torch.randn(2, 3, 8, 8))
    assert calls == [1]
    MaxPool2d(2)(torch.randn(3, 8, 8))  # unbatched: torch's module
    MaxPool2d(2, return_indices=True)(torch.randn(2, 3, 8, 8))
    MaxPool2d(2)(torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last))
    assert calls == [1]


def test_per_example_gradients_under_torch_func_are_torchs():
    """vmap cannot query a channels-last layout: under torch.func it is torch's module."""
    x = torch.randn(6, 3, 8, 8)

    def loss(pool):
        return lambda x1: pool(x1.unsqueeze(0)).square().sum()

    ours = torch.func.vmap(torch.func.grad(loss(MaxPool2d(2))))(x)
    theirs = torch.func.vmap(torch.func.grad(loss(nn.MaxPool2d(2))))(x)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["cnn-gn", "dpfl-cnn", "dpnas-mnist"])
def test_a_model_trains_to_the_same_weights_as_with_torchs_pooling(name):
    """Three SGD steps of a model built with the fast path and of its copy with torch's modules:
    the same weights, bit for bit (the embedded default's numbers do not move)."""
    torch.manual_seed(0)
    fast = MODEL_NAMES[name](num_classes=5, in_chans=1, groups=4, width=8)
    slow = MODEL_NAMES[name](num_classes=5, in_chans=1, groups=4, width=8)
    slow.load_state_dict(fast.state_dict())
    swapped = 0
    for parent in slow.modules():
        for n, child in parent.named_children():
            if isinstance(child, MaxPool2d):
                plain = nn.MaxPool2d(
                    child.kernel_size, child.stride, child.padding, child.dilation,
                    ceil_mode=child.ceil_mode,
                )  # fmt: skip
                setattr(parent, n, plain)
                swapped += 1
    assert swapped >= 2
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (fast, slow)]
    for _ in range(3):
        x = torch.randn(16, 1, 28, 28, generator=g)
        y = torch.randint(0, 5, (16,), generator=g)
        for m, opt in zip((fast, slow), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    for a, b in zip(fast.parameters(), slow.parameters(), strict=True):
        assert torch.equal(a, b)
