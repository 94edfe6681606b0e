"""The paper's ResNet20 and a small CNN, both with GroupNorm so that per-sample gradients exist.

BatchNorm mixes examples within a batch, which breaks per-example sensitivity; GroupNorm does
not, and Opacus' ModuleValidator accepts it. Both expose timm's classifier interface
(`get_classifier`/`reset_classifier`) so head swapping is one code path for every backbone.
"""

from __future__ import annotations

import torch
from torch import nn

from dpadapter.models.pooling import MaxPool2d


class _HeadMixin:
    head: nn.Linear

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        self.head = nn.Linear(self.head.in_features, num_classes)


def gn_stem(in_chans: int, width: int, groups: int) -> nn.Module:
    """3x3 stride-1 conv + GroupNorm + ReLU: the CIFAR-style stem of the GroupNorm ResNets."""
    return nn.Sequential(
        nn.Conv2d(in_chans, width, 3, 1, 1, bias=False),
        nn.GroupNorm(min(groups, width), width),
        nn.ReLU(),
    )


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(min(groups, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(min(groups, c_out), c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                nn.GroupNorm(min(groups, c_out), c_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet20GN(_HeadMixin, nn.Module):
    """He et al.'s CIFAR ResNet-20 (3 stages x 3 basic blocks, 16/32/64 channels)."""

    def __init__(self, num_classes: int, in_chans: int = 3, groups: int = 16, width: int = 16):
        super().__init__()
        widths = (width, 2 * width, 4 * width)
        self.stem = gn_stem(in_chans, widths[0], groups)
        layers, c = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(3):
                layers.append(BasicBlock(c, w, 2 if (i > 0 and j == 0) else 1, groups))
                c = w
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class SmallCNN(_HeadMixin, nn.Module):
    """Three conv-GN-ReLU stages and a linear head: the embedded default's fast backbone."""

    def __init__(self, num_classes: int, in_chans: int = 1, groups: int = 8, width: int = 32):
        super().__init__()
        widths = (width // 2, width, 2 * width)
        blocks, c = [], in_chans
        for w in widths:
            blocks += [
                nn.Conv2d(c, w, 3, 1, 1),
                nn.GroupNorm(min(groups, w), w),
                nn.ReLU(),
                MaxPool2d(2),
            ]
            c = w
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))
