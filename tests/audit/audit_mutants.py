"""Test-only broken variants of the algorithm base: the audit must see the blatant ones.

None is registered by import: tests put them into ALGORITHMS with monkeypatch.setitem, so no
production code path can reach them. Each overrides one phase of `DPAlgorithm`, as a real
(buggy) variant would, and leaves the ledger recording what the correct algorithm would.
"""

from __future__ import annotations

import torch
from opacus.optimizers import DPOptimizer

from dpadapter.algorithms.base import DPAlgorithm


class NonPrivate(DPAlgorithm):
    """sigma = 0 and no clipping, while the ledger records the calibrated sigma."""

    def release_noise_multiplier(self, accounted: float) -> float:
        return 0.0

    def accounted_noise_multiplier(self, opt: DPOptimizer) -> float:
        return self.sigma

    def make_optimizer(self, optimizer: torch.optim.Optimizer, wrapped) -> DPOptimizer:
        opt = self._new_optimizer(
            DPOptimizer,
            wrapped,
            optimizer,
            noise_multiplier=0.0,
            max_grad_norm=1e12,  # clip factor min(1, C/norm) = 1: nothing is clipped
            expected_batch_size=self.spec.expected_batch_size,
            loss_reduction="mean",
            generator=self.generator,
        )
        return self._attach(opt)


class NoiseDividedBy10(DPAlgorithm):
    """The noise std is sigma*C/10, while the ledger records sigma."""

    def release_noise_multiplier(self, accounted: float) -> float:
        return accounted / 10

    def accounted_noise_multiplier(self, opt: DPOptimizer) -> float:
        return opt.noise_multiplier * 10


class LedgerResetMidRun(DPAlgorithm):
    """The mechanism is as calibrated, but the ledger forgets the first half of the steps, so
    the epsilon the pipeline prints is too small."""

    _reset_done = False

    def _on_release(self, opt: DPOptimizer) -> None:
        super()._on_release(opt)
        if not self._reset_done and self.ledger.steps == self.spec.total_steps // 2:
            self.ledger.history = []
            self._reset_done = True


def _skip_clip_optimizer(skip: int):
    class SkipClip(DPOptimizer):
        """Opacus' clip phase, then parameter `skip` gets its unclipped per-example sum."""

        def clip_and_accumulate(self) -> None:
            p = self.params[skip]
            before = getattr(p, "summed_grad", None)
            before = None if before is None else before.clone()
            raw = self._get_flat_grad_sample(p).to(p.dtype).sum(0)
            super().clip_and_accumulate()
            p.summed_grad = raw if before is None else before + raw

    return SkipClip


class ClipSkippedForWeight(DPAlgorithm):
    """Per-example clipping skipped for the audit model's weight (where the canaries'
    gradients live)."""

    optimizer_class = _skip_clip_optimizer(0)


class ClipSkippedForBias(DPAlgorithm):
    """Per-example clipping skipped for the bias (shared by every example, no canary
    coordinate)."""

    optimizer_class = _skip_clip_optimizer(1)
