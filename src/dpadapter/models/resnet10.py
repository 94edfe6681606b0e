"""GNResNet-10: the DP-SAT paper's large from-scratch model (Table 2, 4.90M parameters).

A ResNet-18-style network with one basic block per stage (stages of 64/128/256/512 channels at
`width=64`), a 3x3 stride-1 stem without max-pooling (the CIFAR-style stem of 28/32-pixel
inputs) and GroupNorm in place of BatchNorm. The paper names the model but gives no definition;
this reading reproduces its parameter count: 4.90M for 10 classes (4,902,090 with 1 input
channel, 16 groups; `tests/models` checks the count). The GroupNorm group count is not stated;
`model.groups` (configs/dpsat-table2.yaml: 16) is an assumption.
"""

from __future__ import annotations

import torch
from torch import nn

from dpadapter.models.nets import BasicBlock, _HeadMixin, gn_stem


class GNResNet10(_HeadMixin, nn.Module):
    def __init__(self, num_classes: int, in_chans: int = 1, groups: int = 16, width: int = 64):
        super().__init__()
        widths = (width, 2 * width, 4 * width, 8 * width)
        self.stem = gn_stem(in_chans, widths[0], groups)
        blocks, c = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(c, w, 1 if i == 0 else 2, groups))
            c = w
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.layers(self.stem(x))), 1))
