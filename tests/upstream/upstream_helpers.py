"""Small in-memory data and models shared by the upstream tests (no dataset files, no MLflow)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.data.tasks import RoleData
from dpadapter.models import create_model
from dpadapter.settings import ModelConfig
from dpadapter.upstream import UpstreamContext

N_CLASSES = 3


def indexed_data(n: int, seed: int = 0) -> TensorDataset:
    """Random 8x8 images whose pixel (0, 0) holds the example's index, so a model's input reveals
    which examples a batch contained; labels depend on the image so the loss is learnable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    bottom_right = x[:, 0, 4:, 4:].mean(dim=(1, 2)) > 0
    top_left = x[:, 0, :4, :4].mean(dim=(1, 2)) > 0.3
    y = bottom_right.long() + top_left.long()
    x[:, 0, 0, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, y)


def decode(x: torch.Tensor) -> list[int]:
    return x[:, 0, 0, 0].round().long().tolist()


def small_model(seed: int = 0) -> nn.Module:
    return create_model(ModelConfig(name="cnn-gn", groups=4, width=8), N_CLASSES, 1, seed)


def context(
    data: TensorDataset, model: nn.Module | None, log: Callable[[int, dict], None], seed: int = 0
) -> UpstreamContext:
    """What a perturbed upstream method reads from its context: public.train, the warm-up model,
    the seed and the logger; config and split plan are not needed, so they are left out."""
    role = RoleData("public", N_CLASSES, data, data, data, allocation=None)  # type: ignore[arg-type]
    return UpstreamContext(None, None, role, model, seed, log)  # type: ignore[arg-type]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class ForwardRecorder:
    """Records, for every forward call, the input batch and a copy of the parameters."""

    def __init__(self, model: nn.Module, snapshot_params: bool = False):
        self.inputs: list[torch.Tensor] = []
        self.params: list[list[torch.Tensor]] = []
        self.snapshot = snapshot_params
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple) -> None:
        self.inputs.append(args[0].detach().clone())
        if self.snapshot:
            self.params.append(params_of(module))

    def clear(self) -> None:
        self.inputs.clear()
        self.params.clear()

    def remove(self) -> None:
        self.handle.remove()
