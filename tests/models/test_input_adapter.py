"""The input adapter: native-size data in, the backbone's size, channels and normalisation out."""

from __future__ import annotations

import math

import torch

from dpadapter.models import create_model
from dpadapter.models.input_adapter import AdaptedModel, AdapterSpec, InputAdapter, adapt
from dpadapter.settings import ModelConfig
from dpadapter.upstream.external import External

VIT_ARGS = {"img_size": 32, "patch_size": 8, "depth": 2}


def _bilinear_by_hand(img: torch.Tensor, out: int) -> torch.Tensor:
    """Half-pixel-centre bilinear resize of one HxW image, written out pixel by pixel."""
    h, w = img.shape
    res = torch.empty(out, out, dtype=img.dtype)
    for i in range(out):
        for j in range(out):
            sy = max((i + 0.5) * h / out - 0.5, 0.0)
            sx = max((j + 0.5) * w / out - 0.5, 0.0)
            y0, x0 = math.floor(sy), math.floor(sx)
            y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
            dy, dx = sy - y0, sx - x0
            res[i, j] = (
                img[y0, x0] * (1 - dy) * (1 - dx)
                + img[y0, x1] * (1 - dy) * dx
                + img[y1, x0] * dy * (1 - dx)
                + img[y1, x1] * dy * dx
            )
    return res


def test_fashion_mnist_batch_into_a_three_channel_32px_vit():
    method = External(
        {
            "model": "timm:vit_tiny_patch16_224",
            "weights": {"file": "unused.pth"},
            "timm_args": VIT_ARGS,
        }
    )
    spec = method.adapter_spec(data_in_chans=1)
    # size from img_size, channels and mean/std from the checkpoint's own pretrained_cfg
    assert spec == AdapterSpec(size=32, channels=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    torch.manual_seed(0)
    x = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    want = torch.empty(2, 3, 32, 32, dtype=torch.float64)
    for n in range(2):
        resized = _bilinear_by_hand(x[n, 0], 32)
        for c in range(3):
            want[n, c] = (resized - 0.5) / 0.5
    got = InputAdapter(spec)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    backbone = create_model(ModelConfig("timm:vit_tiny_patch16_224"), 4, 3, 0, timm_args=VIT_ARGS)
    model = adapt(backbone.double(), spec)
    assert isinstance(model, AdaptedModel) and model.get_classifier() is backbone.head
    model.eval()
    torch.testing.assert_close(model(x), backbone(want), rtol=0, atol=1e-12)
    # nothing to train, nothing in the state dict: the spec is rebuilt from the checkpoint record
    assert not list(model.adapter.parameters()) and not model.adapter.state_dict()


def test_explicit_stats_and_no_op_adapter():
    x = torch.rand(3, 3, 32, 32, dtype=torch.float64)
    spec = AdapterSpec(mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 2.0))
    mean = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor([0.5, 0.25, 2.0], dtype=torch.float64).view(1, 3, 1, 1)
    torch.testing.assert_close(InputAdapter(spec)(x), (x - mean) / std, rtol=0, atol=0)
    # same size, same channels, no normalisation: the backbone is used as it is
    net = torch.nn.Linear(2, 2)
    assert adapt(net, AdapterSpec()) is net and adapt(net, None) is net
    assert AdapterSpec.from_dict(spec.to_dict()) == spec
