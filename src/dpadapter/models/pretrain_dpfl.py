"""Pretrain-DPFL's CNN (Sec. 4.1: "two convolutional and two fully connected layers",
feature extractor p = 543,808 parameters, head n = 1,290 for 10 classes).

The count pins the shapes down: 3x3 convolutions 3 -> 32 and 32 -> 64 (with biases), each
followed by ReLU and 2x2 max-pooling, so a 3x32x32 input leaves a 64x8x8 = 4096 map, then a
4096 -> 128 fully connected layer: 896 + 18,496 + 524,416 = 543,808 exactly; the head 128 -> 10
is the second fully connected layer (n = 1,290). So p counts the feature extractor without the
head, and there is no normalisation layer at all (any affine norm would add parameters), as in
the FedAvg CNN the paper cites. `width` scales the channels (32, 64) and the hidden layer
(4 * width = 128) as in the pipeline's other nets; `width: 32` is the paper's.

The paper's ResNet20 (p = 1,092,816, n = 1,290) is `resnet20-gn` at `width: 32`: n = 1,290
means 128 features, so the widths are 32/64/128 (twice He et al.'s CIFAR ResNet-20), and its
feature extractor has 1,083,296 parameters with 1x1-conv + GroupNorm projection shortcuts
(0.87 % fewer; no principled ResNet-20 layout gives the paper's count exactly).

An 8x8 adaptive average pool sits before the first fully connected layer: the identity on the
paper's 3x32x32 inputs, and it keeps the parameter count on other input sizes.
"""

from __future__ import annotations

import torch
from torch import nn

from dpadapter.models.nets import _HeadMixin
from dpadapter.models.pooling import MaxPool2d


class PretrainDPFLCNN(_HeadMixin, nn.Module):
    def __init__(self, num_classes: int, in_chans: int = 3, groups: int = 8, width: int = 32):
        super().__init__()
        del groups  # no normalisation layers: the paper's parameter count has none
        c1, c2, hidden = width, 2 * width, 4 * width
        self.features = nn.Sequential(
            nn.Conv2d(in_chans, c1, 3, 1, 1),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, 1, 1),
            nn.ReLU(),
            MaxPool2d(2),
            nn.AdaptiveAvgPool2d(8),
            nn.Flatten(),
            nn.Linear(c2 * 64, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
