"""`finetune.grad_sample_mode` -> the wrapped model and the optimizer that clips with it.

Opacus' modes (hooks, functorch, ew) store per-example gradients; `bk` is the hand-written
book-keeping path (dpadapter.privacy.bookkeeping) that clips without storing them. An algorithm
that reads per-example gradients itself (`needs_per_sample_gradients`, GEP) gets Opacus' hooks
under `bk`; metrics.json records the mode that actually ran.
"""

from __future__ import annotations

import functools

from opacus.grad_sample.utils import wrap_model
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.device import full_fp32
from dpadapter.privacy.bookkeeping import BookKeepingModule, attach_bookkeeping

GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "bk")


def effective_mode(mode: str, needs_per_sample_gradients: bool) -> str:
    if mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"unknown grad_sample_mode {mode!r}; known: {GRAD_SAMPLE_MODES}")
    return "hooks" if mode == "bk" and needs_per_sample_gradients else mode


def wrap_for_dp(model: nn.Module, mode: str, needs_per_sample_gradients: bool = False) -> nn.Module:
    """The module to train (loss reduction 'mean', batch first, as everywhere here)."""
    mode = effective_mode(mode, needs_per_sample_gradients)
    if mode == "bk":
        return BookKeepingModule(model, loss_reduction="mean")
    return wrap_model(model, grad_sample_mode=mode, batch_first=True, loss_reduction="mean")


def bind_optimizer(opt: DPOptimizer, wrapped: nn.Module) -> DPOptimizer:
    """The DP optimizer made by the algorithm, clipping the way `wrapped` records gradients.

    Every mode clips in full FP32 (`device.full_fp32`): Opacus' clip takes the norms and the
    clipped sum (an einsum) with different kernels, and under TF32 a clipped example could add
    ~1e-3 more than C to the sum. The per-example gradients themselves may come from TF32
    kernels: the bound holds for whatever vector is clipped, as long as the clip is exact.
    """
    if isinstance(wrapped, BookKeepingModule):
        return attach_bookkeeping(opt, wrapped)  # bk's own clip runs under full_fp32
    clip = opt.clip_and_accumulate

    @functools.wraps(clip)
    def clip_and_accumulate(*args, **kwargs):
        with full_fp32():
            return clip(*args, **kwargs)

    opt.clip_and_accumulate = clip_and_accumulate
    return opt
