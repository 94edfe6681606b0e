"""DPNAS-MNIST: the architecture Cheng et al. (AAAI 2022) found by DP-aware search (0.21M params).

The DP-SAT paper (Table 2) trains it from scratch on MNIST and Fashion-MNIST and refers to the
DPNAS code for its definition. Reconstructed here from that published description (facts of
the architecture, written anew):

- stem: 3x3 conv 1 -> 32 channels (no bias) + GroupNorm(8 groups, no affine);
- six layers: searched cells at layers 0, 2 and 4 (16, 16 and 32 channels per node; the last
  doubles), 2x2 max-pooling at layers 1, 3 and 5 (28 -> 14 -> 7 -> 3 pixels);
- a cell: a 1x1 conv + GroupNorm preprocesses its input into node 0; nodes 1..5 each sum the
  operations on the edges from earlier nodes; the cell outputs the concatenation of nodes 1..5
  (5x the node width). The searched edges (operation, from, to) are `MNIST_CELL` below, with
  operations from the DP search space: zero, 3x3 max/avg pooling (stride 1), identity, and
  3x3 depthwise convolution + GroupNorm followed by ReLU, SELU, tanh, identity, hard tanh or
  sigmoid;
- head: 1x1 conv to 128 channels + GroupNorm, flatten (128 x 3 x 3), Linear 1152 -> 128, tanh,
  Linear 128 -> classes (the classifier this pipeline swaps per task is the last Linear).

Convolutions start from N(0, 2/n), n = kernel area x output channels, as in the DPNAS code;
linear layers from PyTorch's default. GroupNorm has no affine parameters anywhere, as in the
search space. The count is 0.21M for 10 classes (`tests/models` checks it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpadapter.models.pooling import MaxPool2d

# (operation, from node, to node) of the searched MNIST cell.
MNIST_CELL = (
    ("sep_selu", 0, 1),
    ("sep_tanh", 0, 2),
    ("skip", 1, 2),
    ("zero", 0, 3),
    ("sep_selu", 1, 3),
    ("sep_relu", 2, 3),
    ("zero", 0, 4),
    ("sep_tanh", 1, 4),
    ("zero", 2, 4),
    ("skip", 3, 4),
    ("max_pool", 0, 5),
    ("zero", 1, 5),
    ("max_pool", 2, 5),
    ("max_pool", 3, 5),
    ("sep_relu", 4, 5),
)
NODES = 5
_GN_GROUPS = 8


def _gn(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(_GN_GROUPS, c, affine=False)


class _Zero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul(0.0)


def _depthwise(c: int, act: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False), _gn(c), act)


_OPS = {
    "zero": lambda c: _Zero(),
    "max_pool": lambda c: MaxPool2d(3, 1, 1),
    "avg_pool": lambda c: nn.AvgPool2d(3, 1, 1),
    "skip": lambda c: nn.Identity(),
    "sep_relu": lambda c: _depthwise(c, nn.ReLU()),
    "sep_selu": lambda c: _depthwise(c, nn.SELU()),
    "sep_tanh": lambda c: _depthwise(c, nn.Tanh()),
    "sep_linear": lambda c: _depthwise(c, nn.Identity()),
    "sep_htanh": lambda c: _depthwise(c, nn.Hardtanh()),
    "sep_sigmoid": lambda c: _depthwise(c, nn.Sigmoid()),
}


class DPNASCell(nn.Module):
    def __init__(self, c_in: int, c: int, edges=MNIST_CELL):
        super().__init__()
        self.pre = nn.Sequential(nn.Conv2d(c_in, c, 1, bias=False), _gn(c))
        self.edges = tuple((src, dst) for _, src, dst in edges)
        self.ops = nn.ModuleList(_OPS[op](c) for op, _, _ in edges)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes: dict[int, torch.Tensor] = {0: self.pre(x)}
        for (src, dst), op in zip(self.edges, self.ops, strict=True):
            out = op(nodes[src])
            nodes[dst] = nodes[dst] + out if dst in nodes else out
        return torch.cat([nodes[i] for i in range(1, NODES + 1)], dim=1)


class DPNASMNIST(nn.Module):
    def __init__(self, num_classes: int, in_chans: int = 1, groups: int = 8, width: int = 16):
        super().__init__()
        c = 2 * width
        self.stem = nn.Sequential(nn.Conv2d(in_chans, c, 3, padding=1, bias=False), _gn(c))
        layers: list[nn.Module] = []
        c_prev, c_node = c, c
        for i in range(6):
            if i % 2 == 1:
                layers.append(MaxPool2d(2, 2))
                continue
            if i == 4:
                c_node *= 2
            layers.append(DPNASCell(c_prev, c_node))
            c_prev = NODES * c_node
        self.cells = nn.Sequential(*layers)
        self.adapt = nn.Sequential(nn.Conv2d(c_prev, 128, 1, bias=False), _gn(128))
        self.hidden = nn.Sequential(nn.Flatten(), nn.LazyLinear(128), nn.Tanh())
        self.head = nn.Linear(128, num_classes)
        # The flattened size depends on the input side (28 -> 3x3); materialise it now so the
        # parameter count, Opacus' validation and checkpoints see real tensors.
        with torch.no_grad():
            self.hidden(self.adapt(self.cells(self.stem(torch.zeros(1, in_chans, 28, 28)))))
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                    m.weight.normal_(0.0, math.sqrt(2.0 / n))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        self.head = nn.Linear(self.head.in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.adapt(self.cells(self.stem(x)))))
