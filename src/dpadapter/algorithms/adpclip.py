"""AdpClip: adaptive quantile clipping (Andrew et al. 2021) on Opacus' AdaClipDPOptimizer.

Each step answers two Gaussian queries on the same Poisson batch: the clipped gradient sum
(sensitivity C_t, noise z_grad * C_t) and the centred count of unclipped examples
sum_i (b_i - 1/2), b_i = [||g_i|| <= C_t] (sensitivity 1/2, noise sigma_b). Their joint
multiplier is (z_grad^-2 + (2 sigma_b)^-2)^-1/2; Andrew et al.'s Theorem 1 picks
z_grad = (sigma^-2 - (2 sigma_b)^-2)^-1/2 so that it equals sigma, the calibrated multiplier,
which is what the ledger records (Opacus >= 1.6 keeps sigma in `noise_multiplier` and inflates
only the noise it draws; Opacus <= 1.5.4 exposed the inflated z_grad, and recording that
under-reported epsilon). Hence sigma < 2 sigma_b is required.

Two corrections to Opacus 1.6 that the accounting depends on, both in a small subclass:
- The count must be the centred one: Opacus adds noise to sum_i b_i, whose sensitivity is 1,
  not 1/2, and with it the pair's joint multiplier would be (z_grad^-2 + sigma_b^-2)^-1/2 < sigma.
  The clip update here uses (noisy count - n/2) / m + 1/2, i.e. the noisy centred count
  normalised by the expected batch size m (public), as in Andrew et al. Opacus divides by the
  realised batch size n, which is itself a sensitivity-1 count released without noise.
- With virtual batches Opacus resets the count at every physical batch (its zero_grad), so the
  estimate covered only the last physical batch; here it covers the logical batch.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer
from torch import nn

from dpadapter.algorithms.base import DPAlgorithm, Release, register_algorithm
from dpadapter.ground.device import Place
from dpadapter.ground.param_schema import FRACTION, NON_NEGATIVE, POSITIVE, nullable, params_object
from dpadapter.per_sample.clip import clip_factors


def gradient_noise_multiplier(sigma: float, count_noise: float) -> float:
    """Andrew et al. Theorem 1: the gradient's share of a joint multiplier sigma."""
    if sigma == 0:
        return 0.0
    return (sigma**-2 - (2 * count_noise) ** -2) ** -0.5


class CentredAdaClipOptimizer(AdaClipDPOptimizer):
    """Opacus' adaptive clipping with the centred, expected-batch-size quantile estimate."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.count_signal: float | None = None  # last release's centred count, and its noise
        self.count_noise: float | None = None
        self.sample_size = 0
        self.unclipped_num = self._zero_count()

    def _zero_count(self) -> torch.Tensor:
        """The count lives where its noise is drawn (Opacus uses it as the noise's reference)."""
        return torch.zeros((), device=self.generator.device if self.generator else None)

    def zero_grad(self, set_to_none: bool = False) -> None:
        skipped = self._is_last_step_skipped
        counts = (self.sample_size, self.unclipped_num)
        super().zero_grad(set_to_none)
        if skipped:  # inside a logical batch: keep counting
            self.sample_size, self.unclipped_num = counts
        else:
            self.sample_size, self.unclipped_num = 0, self._zero_count()

    def clip_and_accumulate(self) -> None:
        """Count, then DPOptimizer's clipping.

        Opacus' AdaClip version `view`s the per-sample gradients, which fails on the strided
        ones of expanded-weights mode and on empty batches; the count is taken here with the
        clip factor DPOptimizer then applies (norms are computed twice, a small cost next to the
        per-sample gradients themselves).
        """
        samples = self.grad_samples
        n = len(samples[0])
        if n:
            norms = torch.stack([g.reshape(n, -1).norm(2, dim=-1) for g in samples], dim=1)
            self.observe_norms(norms.norm(2, dim=1))
        DPOptimizer.clip_and_accumulate(self)

    def observe_norms(self, norms: torch.Tensor) -> None:
        """Count the examples the clip leaves alone (book-keeping clipping calls this too)."""
        n = len(norms)
        if not n:
            return
        factor = clip_factors(norms, self.max_grad_norm)
        unclipped = factor >= 1
        valid = getattr(self, "valid_rows", None)  # padded rows are not examples
        if valid is not None:
            unclipped = unclipped & valid
            n = int(valid.sum())
        self.unclipped_num = self.unclipped_num + unclipped.sum()
        self.sample_size += n

    def add_noise(self) -> None:
        centred = float(self.unclipped_num) - self.sample_size / 2
        super().add_noise()  # gradient noise at the inflated multiplier, count noise sigma_b
        noisy = float(self.unclipped_num) - self.sample_size / 2
        self.count_signal, self.count_noise = centred, noisy - centred

    def update_max_grad_norm(self) -> None:
        m = self.expected_batch_size
        frac = (float(self.unclipped_num) - self.sample_size / 2) / m + 0.5
        c = self.max_grad_norm * math.exp(
            -self.clipbound_learning_rate * (frac - self.target_unclipped_quantile)
        )
        self.max_grad_norm = float(min(max(c, self.min_clipbound), self.max_clipbound))


@register_algorithm("adpclip")
class AdpClip(DPAlgorithm):
    """Clip bound C_t tracks the `target_quantile` of per-example gradient norms.

    C_{t+1} = C_t * exp(-clip_lr * (b~_t - target_quantile)), b~_t the noisy unclipped fraction;
    C_0 = finetune.max_grad_norm. `count_noise` (sigma_b) None takes m/20, Andrew et al.'s
    recommendation for expected batch size m, or sigma if that is larger.
    """

    optimizer_class: ClassVar[type[CentredAdaClipOptimizer]] = CentredAdaClipOptimizer
    distributed_refusal: ClassVar[str | None] = (
        "AdpClip's noisy count of unclipped examples (its clip-bound update) is counted and "
        "noised per process; summing it across processes is not implemented"
    )
    mechanism_note: ClassVar[str | None] = (
        "AdpClip answers two Gaussian queries per step on the same Poisson batch: the clipped "
        "gradient sum (sensitivity C_t, noise multiplier (sigma^-2 - (2 sigma_b)^-2)^-1/2) and "
        "the centred unclipped count (sensitivity 1/2, noise std sigma_b); their joint "
        "multiplier is exactly sigma, which the ledger records (Andrew et al. 2021, Theorem 1)."
    )

    params_schema = params_object(
        target_quantile=FRACTION,
        clip_lr=NON_NEGATIVE,
        count_noise=nullable(POSITIVE),
        min_clip=POSITIVE,
        max_clip=POSITIVE,
    )

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {
            "target_quantile": 0.5,
            "clip_lr": 0.2,
            "count_noise": None,
            "min_clip": 1e-6,
            "max_clip": 1e6,
        }

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._clip: float | None = None  # restored clip bound waiting for the optimizer

    @property
    def count_noise(self) -> float:
        b = self.params["count_noise"]
        if b is not None:
            return float(b)
        # m/20 (Andrew et al.), but at least sigma: small batches would otherwise violate
        # sigma < 2 sigma_b; at sigma_b >= sigma the gradient noise grows by at most 1/sqrt(3/4).
        return max(self.spec.expected_batch_size / 20, self.sigma)

    def _check(self, sigma: float) -> None:
        if not sigma < 2 * self.count_noise:
            raise ValueError(
                f"adpclip: noise multiplier {sigma:.4g} must be < 2 * count_noise "
                f"({2 * self.count_noise:.4g}); raise algo_params.adpclip.count_noise"
            )

    def make_optimizer(self, optimizer: torch.optim.Optimizer, wrapped: nn.Module) -> DPOptimizer:
        sigma = self.noise_multiplier(0)
        self._check(sigma)
        opt = self._new_optimizer(
            self.optimizer_class,
            wrapped,
            optimizer,
            noise_multiplier=sigma,
            target_unclipped_quantile=float(self.params["target_quantile"]),
            clipbound_learning_rate=float(self.params["clip_lr"]),
            max_clipbound=float(self.params["max_clip"]),
            min_clipbound=float(self.params["min_clip"]),
            unclipped_num_std=self.count_noise,
            max_grad_norm=self.spec.max_grad_norm if self._clip is None else self._clip,
            expected_batch_size=self.spec.expected_batch_size,
            loss_reduction="mean",
            generator=self.generator,
        )
        self._clip = None
        return self._attach(opt)

    def start_epoch(self, epoch: int) -> None:
        self._check(self.noise_multiplier(epoch))
        super().start_epoch(epoch)

    def accounted_noise_multiplier(self, opt: DPOptimizer) -> float:
        # Opacus >= 1.6 keeps the joint sigma here and inflates only the noise it draws.
        return float(opt.noise_multiplier)

    def describe_release(self, opt: DPOptimizer) -> list[Release]:
        assert isinstance(opt, CentredAdaClipOptimizer)
        z = gradient_noise_multiplier(opt.noise_multiplier, opt.unclipped_num_std)
        grad = self._gradient_release("gradient", opt, z)
        count = Release("centred unclipped count", 0.5, float(opt.unclipped_num_std))
        if self.audit is not None:
            count = Release(
                count.name,
                count.sensitivity,
                count.noise_std,
                torch.tensor([opt.count_signal]),
                torch.tensor([opt.count_noise]),
            )
        return [grad, count]

    @property
    def clip(self) -> float:
        if self.optimizer is not None:
            return float(self.optimizer.max_grad_norm)
        return self.spec.max_grad_norm if self._clip is None else self._clip

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "clip": self.clip}

    def epoch_stats(self) -> dict[str, float]:
        # C_t: moved only by the noisy counts (post-processing of accounted releases)
        return {"clip": self.clip}

    def restore(self, state: dict[str, Any], place: Place) -> None:
        if self.optimizer is not None:
            self.optimizer.max_grad_norm = float(state["clip"])
        else:
            self._clip = float(state["clip"])

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "count_noise": self.count_noise}
