"""Small federations on random data: a tiny CNN, a few clients, a few rounds."""

import pytest
import torch
from opacus.grad_sample.utils import wrap_model
from torch.utils.data import TensorDataset

from dpadapter.models import create_model
from dpadapter.settings import ModelConfig


def make_data(n: int, seed: int = 0, classes: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.randn(n, 1, 12, 12, generator=g) + y.view(-1, 1, 1, 1).float() * 0.3
    return TensorDataset(x, y)


def make_gsm(seed: int = 0):
    model = create_model(ModelConfig("cnn-gn", 4, 8), num_classes=5, in_chans=1, seed=seed)
    return model, wrap_model(
        model, grad_sample_mode="hooks", batch_first=True, loss_reduction="mean"
    )


@pytest.fixture
def tiny_model():
    return make_gsm(0)
