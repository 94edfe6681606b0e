"""Fit a task's images to a pre-trained backbone inside the model, not on disk.

A backbone pre-trained elsewhere expects its own input: a side (224 for most ViTs), a channel
count (3), and the mean/std of its pre-training (its timm `pretrained_cfg`, public numbers). The
data stays at its native size in memory (a 32x32 CIFAR task is never stored at 224x224); the
`InputAdapter` in front of the backbone resizes (bilinear), replicates a one-channel image to
the backbone's channels and normalises, per batch. It has no trainable parameter and reads no
data, so it costs no privacy and needs no per-example gradient.

When the adapter normalises, the images must reach it in [0, 1]: `dpadapter.validation.compose`
requires `data.normalization` to be the identity (mean 0, std 1) for such a config, so the
pipeline's own normalisation does not apply twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AdapterSpec:
    """What the adapter does, resolved to numbers (recorded in checkpoints as a dict)."""

    size: int | None = None  # side of the backbone's input; None keeps the data's
    channels: int | None = None  # backbone's channels; None keeps the data's
    mean: tuple[float, ...] | None = None  # None: no normalisation here
    std: tuple[float, ...] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AdapterSpec:
        mean, std = d.get("mean"), d.get("std")
        return cls(
            size=d.get("size"),
            channels=d.get("channels"),
            mean=tuple(float(v) for v in mean) if mean is not None else None,
            std=tuple(float(v) for v in std) if std is not None else None,
        )


class InputAdapter(nn.Module):
    def __init__(self, spec: AdapterSpec):
        super().__init__()
        self.spec = spec
        if (spec.mean is None) != (spec.std is None):
            raise ValueError("input adapter: mean and std go together")
        if spec.mean is not None:
            if len(spec.mean) != len(spec.std):
                raise ValueError("input adapter: as many means as stds")
            if spec.channels is not None and len(spec.mean) not in (1, spec.channels):
                raise ValueError(
                    f"input adapter: {len(spec.mean)} means for {spec.channels} channels"
                )
            # Not in the state dict: rebuilt from the checkpoint's recorded spec.
            self.register_buffer("mean", _column(spec.mean), persistent=False)
            self.register_buffer("std", _column(spec.std), persistent=False)
        else:
            self.mean = self.std = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.size is not None and tuple(x.shape[-2:]) != (s.size, s.size):
            x = F.interpolate(x, size=(s.size, s.size), mode="bilinear", align_corners=False)
        if s.channels is not None and x.shape[1] != s.channels:
            if x.shape[1] != 1:
                raise ValueError(
                    f"input adapter: cannot map {x.shape[1]} channels to {s.channels} "
                    "(only a one-channel image is replicated)"
                )
            x = x.expand(-1, s.channels, *x.shape[2:])
        if self.mean is not None:
            x = (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)
        return x

    def extra_repr(self) -> str:
        return f"size={self.spec.size}, channels={self.spec.channels}, mean={self.spec.mean}"


def _column(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float64).view(1, -1, 1, 1)


class AdaptedModel(nn.Module):
    """`adapter` then `backbone`; answers timm's classifier interface for the backbone."""

    def __init__(self, adapter: InputAdapter, backbone: nn.Module):
        super().__init__()
        self.adapter = adapter
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(self.adapter(x))

    def reset_classifier(self, num_classes: int) -> None:
        self.backbone.reset_classifier(num_classes)

    def get_classifier(self) -> nn.Module:
        return self.backbone.get_classifier()


def adapt(backbone: nn.Module, spec: AdapterSpec | None) -> nn.Module:
    """The backbone behind an adapter, or the backbone itself when there is nothing to adapt."""
    if spec is None or spec == AdapterSpec():
        return backbone
    return AdaptedModel(InputAdapter(spec), backbone)
