"""Per-example gradients and clipping: every `grad_sample_mode` in one package.

`finetune.grad_sample_mode` picks how per-example gradients are had: Opacus' modes (hooks,
functorch, ew; `opacus_modes`) store them; `bk` (`bookkeeping`, written here) clips without
storing them. An algorithm that reads per-example gradients itself (`needs_per_sample_gradients`,
GEP) gets Opacus' hooks under `bk`; metrics.json records the mode that actually ran. Every clip
factor comes from `clip.clip_factors`. `precision` is `finetune.precision`: autocast of the
training forward/backward, per-example gradients cast up (and fp16's loss scale divided out)
before the clip, so that norms, clipped sums and noise stay fp32.
factor comes from `clip.clip_factors`. Wrapping with a `check_sample` runs the per-sample
self-test (`self_test`): the mode's per-example norms against torch.func's before any step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.train.per_sample.bookkeeping import BookKeepingModule, attach_bookkeeping
from dpadapter.train.per_sample.clip import clip_factors
from dpadapter.train.per_sample.opacus_modes import OPACUS_MODES, bind_fp32_clip, wrap_opacus
from dpadapter.train.per_sample.precision import PRECISIONS, Precision, make_precision
from dpadapter.train.per_sample.self_test import PerSampleCheckError, run_check

GRAD_SAMPLE_MODES = (*OPACUS_MODES, "bk")

__all__ = [
    "GRAD_SAMPLE_MODES",
    "PRECISIONS",
    "Precision",
    "PerSampleCheckError",
    "bind_optimizer",
    "clip_factors",
    "effective_mode",
    "make_precision",
    "wrap_for_dp",
]


def effective_mode(mode: str, needs_per_sample_gradients: bool) -> str:
    if mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"unknown grad_sample_mode {mode!r}; known: {GRAD_SAMPLE_MODES}")
    return "hooks" if mode == "bk" and needs_per_sample_gradients else mode


def wrap_for_dp(
    model: nn.Module,
    mode: str,
    needs_per_sample_gradients: bool = False,
    check_sample: tuple[Sequence[int], torch.dtype] | None = None,
) -> nn.Module:
    """The module to train (loss reduction 'mean', batch first, as everywhere here).

    `check_sample` (the training data's sample shape and dtype, never its values) runs the
    per-sample self-test; its record is left on the result as `per_sample_check` (None without
    one), and a mismatch raises PerSampleCheckError.
    """
    mode = effective_mode(mode, needs_per_sample_gradients)

    def wrap() -> nn.Module:
        if mode == "bk":
            return BookKeepingModule(model, loss_reduction="mean")
        return wrap_opacus(model, mode)

    if check_sample is None:
        wrapped, record = wrap(), None
    else:
        shape, dtype = check_sample
        wrapped, record = run_check(model, wrap, mode, tuple(shape), dtype)
    wrapped.per_sample_check = record
    return wrapped


def bind_optimizer(
    opt: DPOptimizer, wrapped: nn.Module, precision: Precision | None = None
) -> DPOptimizer:
    """The DP optimizer made by the algorithm, clipping the way `wrapped` records gradients.

    `precision` (mixed precision, `precision.Precision`) learns where the per-example gradients
    are, to check them for fp16 overflow and cast them up before the clip.
    """
    if precision is not None:
        precision.bind(lambda: opt.params, wrapped)
    if isinstance(wrapped, BookKeepingModule):
        return attach_bookkeeping(opt, wrapped)  # bk's own clip runs under full_fp32
    return bind_fp32_clip(opt, precision)
