"""Freezing BatchNorm keeps each module's whole forward (issue 35, item 2).

Generic, not a list of classes: every BatchNorm subclass that torch and timm define (found by
walking `_BatchNorm`'s subclasses) and every BatchNorm in a set of timm families must give the
original eval-mode output once frozen, in either `bn_affine` choice and in training mode too.
timm's `BatchNormAct2d` applies its activation inside its forward; the old `FrozenBatchNorm`
replaced the whole module and dropped it.
"""

from __future__ import annotations

import inspect

import pytest
import timm
import timm.layers  # noqa: F401  (defines timm's BatchNorm subclasses)
import torch
from torch import nn

from dpadapter.models.batchnorm import FrozenBatchNorm, freeze_batchnorm

C = 6


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def _float_batchnorms() -> list[type]:
    """Every float BatchNorm class loaded (quantized ones run on quantized tensors only)."""
    found = _subclasses(nn.modules.batchnorm._BatchNorm)
    return sorted(
        (c for c in found if not c.__module__.startswith("torch.ao") and not inspect.isabstract(c)),
        key=lambda c: f"{c.__module__}.{c.__qualname__}",
    )


def _build(cls: type) -> nn.Module:
    params = inspect.signature(cls).parameters
    return cls(C) if "num_features" in params else cls()


def _input_for(bn: nn.Module) -> torch.Tensor:
    """A float64 batch of a rank the module accepts (BatchNorm1d: 2-3, 2d: 4, 3d: 5)."""
    bn.eval()
    for rank in (4, 3, 5, 2):
        x = torch.randn(4, C, *([3] * (rank - 2)), dtype=torch.float64) * 2 + 1
        try:
            with torch.no_grad():
                bn(x)
            return x
        except (ValueError, RuntimeError, AssertionError):
            continue
    raise AssertionError(f"{type(bn).__name__} accepts no input of rank 2-5")


def _pretrain(model: nn.Module, x: torch.Tensor) -> None:
    """Non-private pre-training stand-in: statistics and affine moved away from their init."""
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(x * torch.rand(()) * 3 + torch.randn(()))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


def _assert_freezing_keeps_eval_outputs(model: nn.Module, x: torch.Tensor, affine: str):
    model.eval()
    with torch.no_grad():
        want = model(x)
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    names = freeze_batchnorm(model, affine)
    assert names and all(isinstance(model.get_submodule(n), FrozenBatchNorm) for n in names)
    for mode in ("eval", "train"):  # a frozen one in training mode changes nothing either
        model.eval()  # (the rest stays in eval: a model's dropout would draw)
        for n in names:
            model.get_submodule(n).train(mode == "train")
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in stats.items())  # names kept, never updated


BN_CLASSES = _float_batchnorms()


def test_the_walk_finds_timms_batchnorm_with_activation():
    names = {c.__name__ for c in BN_CLASSES}
    assert {"BatchNorm2d", "BatchNormAct2d"} <= names


@pytest.mark.parametrize("affine", ["train", "freeze"])
@pytest.mark.parametrize("cls", BN_CLASSES, ids=lambda c: c.__name__)
def test_every_batchnorm_class_keeps_its_forward(cls, affine):
    bn = _build(cls).double()
    x = _input_for(bn)
    model = nn.Sequential(bn)
    _pretrain(model, x)
    if cls.__name__ == "BatchNormAct2d":  # the activation inside is kept: ReLU's floor
        model.eval()
        assert float(model(x).detach().min()) == 0.0
    _assert_freezing_keeps_eval_outputs(model, x, affine)


# One model per family the docs claim; each holds BatchNorm2d and/or BatchNormAct2d.
TIMM_MODELS = [
    "efficientnet_b0",
    "mobilenetv3_small_050",
    "resnetv2_18",
    "regnety_002",
    "resnet18",
    "ghostnet_050",
]


@pytest.mark.parametrize("affine", ["train", "freeze"])
@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_models_keep_their_eval_outputs_once_frozen(name, affine):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=3).double()
    assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    _pretrain(model, x)
    _assert_freezing_keeps_eval_outputs(model, x, affine)
