"""The DP optimizer most per-sample tests build: SGD over the wrapped module's parameters, its
clip the wrapped mode's (`per_sample.dp_optimizer`), and by default no noise and no step, so
that `p.summed_grad` is the clipped sum itself."""

from __future__ import annotations

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.per_sample import Precision, dp_optimizer


def dp_sgd(
    wrapped: nn.Module,
    max_grad_norm: float,
    batch: int,
    *,
    lr: float = 0.0,
    noise: float = 0.0,
    precision: Precision | None = None,
) -> DPOptimizer:
    return dp_optimizer(
        DPOptimizer,
        wrapped,
        torch.optim.SGD(wrapped.parameters(), lr=lr),
        noise_multiplier=noise,
        max_grad_norm=max_grad_norm,
        expected_batch_size=batch,
        precision=precision,
    )
