"""Opacus' per-sample modes (hooks, functorch, ew), wrapped and clipped in full FP32.

Every mode clips in full FP32 (`device.full_fp32`): Opacus' clip takes the norms and the
clipped sum (an einsum) with different kernels, and under TF32 a clipped example could add
~1e-3 more than C to the sum. The per-example gradients themselves may come from TF32 kernels:
the bound holds for whatever vector is clipped, as long as the clip is exact.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from opacus.grad_sample.utils import wrap_model
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.device import full_fp32

if TYPE_CHECKING:
    from dpadapter.train.per_sample.precision import Precision

OPACUS_MODES = ("hooks", "functorch", "ew")


def wrap_opacus(model: nn.Module, mode: str) -> nn.Module:
    return wrap_model(model, grad_sample_mode=mode, batch_first=True, loss_reduction="mean")


def bind_fp32_clip(opt: DPOptimizer, precision: Precision | None = None) -> DPOptimizer:
    """`precision` (mixed precision): per-example gradients cast up and unscaled first."""
    clip = opt.clip_and_accumulate

    @functools.wraps(clip)
    def clip_and_accumulate(*args, **kwargs):
        if precision is not None:
            precision.unscale(opt.params)
        with full_fp32():
            return clip(*args, **kwargs)

    opt.clip_and_accumulate = clip_and_accumulate
    return opt
