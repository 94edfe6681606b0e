"""Shared DP optimizer: one training step in phases that variants override one at a time.

Phases (each a method):
- schedule  `noise_multiplier(epoch)`: sigma for the coming epoch (AdpAlloc decays it);
- calibrate `calibrate(...)`: target epsilon -> sigma (schedule-aware variants override);
- optimizer `make_optimizer(...)`: Opacus DPOptimizer doing the clip and noise phases
  (AdpClip swaps in Opacus' AdaClipDPOptimizer; GEP overrides clip/noise);
- step      `train_step(...)`: forward/backward/step; ascent variants (DP-SAT) perturb the
  weights before the gradient and restore them before the update.
Every release goes through `_on_release` (Opacus' step hook, called only for real, non-skipped
steps) into the run's PrivacyLedger, so the accountant sees exactly the steps taken.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.privacy import PrivacyLedger, calibrate_sigma

ALGORITHMS: dict[str, type[DPAlgorithm]] = {}


def register_algorithm(name: str) -> Callable[[type[DPAlgorithm]], type[DPAlgorithm]]:
    def deco(cls: type[DPAlgorithm]) -> type[DPAlgorithm]:
        if name in ALGORITHMS:
            raise KeyError(f"algorithm {name!r} registered twice")
        cls.name = name
        ALGORITHMS[name] = cls
        return cls

    return deco


@dataclass(frozen=True)
class DPRunSpec:
    """What the algorithm needs to know about the run to calibrate and build its optimizer."""

    target_epsilon: float
    delta: float
    sample_rate: float
    steps_per_epoch: int
    epochs: int
    expected_batch_size: int
    max_grad_norm: float
    accountant: str = "prv"
    params: dict[str, Any] = field(default_factory=dict)
    calibration_cache: str | None = None

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs


class DPAlgorithm:
    """DP-SGD (Abadi et al.) with Opacus: per-sample clipping to C, Gaussian noise sigma*C."""

    name: ClassVar[str] = "base"
    mechanism_note: ClassVar[str | None] = None

    def __init__(self, spec: DPRunSpec, ledger: PrivacyLedger, generator: torch.Generator):
        unknown = set(spec.params) - set(self.default_params())
        if unknown:
            raise ValueError(f"{self.name}: unknown parameters {sorted(unknown)}; known: {sorted(self.default_params())}")
        self.spec = spec
        self.params = {**self.default_params(), **spec.params}
        self.ledger = ledger
        self.generator = generator
        self.sigma = self.calibrate()
        self.optimizer: DPOptimizer | None = None

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {}

    # --- schedule / calibrate phases -------------------------------------------------------
    def calibrate(self) -> float:
        s = self.spec
        return calibrate_sigma(
            s.target_epsilon, s.delta, s.sample_rate, s.total_steps, s.accountant, s.calibration_cache
        )

    def noise_multiplier(self, epoch: int) -> float:
        return self.sigma

    # --- optimizer phase (clip + noise) ------------------------------------------------------
    def make_optimizer(self, optimizer: torch.optim.Optimizer) -> DPOptimizer:
        opt = DPOptimizer(
            optimizer,
            noise_multiplier=self.noise_multiplier(0),
            max_grad_norm=self.spec.max_grad_norm,
            expected_batch_size=self.spec.expected_batch_size,
            loss_reduction="mean",
            generator=self.generator,
        )
        return self._attach(opt)

    def _attach(self, opt: DPOptimizer) -> DPOptimizer:
        opt.attach_step_hook(self._on_release)
        self.optimizer = opt
        return opt

    def _on_release(self, opt: DPOptimizer) -> None:
        self.ledger.record(opt.noise_multiplier, self.spec.sample_rate, 1)

    def start_epoch(self, epoch: int) -> None:
        assert self.optimizer is not None
        self.optimizer.noise_multiplier = self.noise_multiplier(epoch)

    # --- step phase ----------------------------------------------------------------------------
    def train_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> float:
        """One physical batch; the optimizer skips the update until the logical batch ends."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        if len(y) == 0:
            return self.empty_step(model)
        loss = loss_fn(model(x), y)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def empty_step(self, model: nn.Module) -> float:
        """A Poisson batch can be empty: the release still happens (noise only), as accounted."""
        assert self.optimizer is not None
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.optimizer.step()
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sigma = state["sigma"]

    def describe(self) -> dict[str, Any]:
        """Hyperparameters for metrics.json and MLflow."""
        return {"algorithm": self.name, "noise_multiplier": self.sigma, **self.params}
