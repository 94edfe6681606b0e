"""Shared DP optimizer: one training step in phases that variants override one at a time.

Phases (each a method):
- schedule  `noise_multiplier(epoch)`: accounted sigma for the coming epoch (AdpAlloc decays it);
- calibrate `calibrate(...)`: target epsilon -> sigma (schedule-aware variants override);
- optimizer `make_optimizer(optimizer, wrapped)`: Opacus DPOptimizer doing the clip and noise
  phases (AdpClip swaps in Opacus' AdaClipDPOptimizer; GEP overrides clip/noise), built behind
  the clip of the wrapped module's per-sample mode (`per_sample.optimizers.optimizer_class`);
- ascent    `before_gradient(...)`: runs before each physical batch's gradient (DP-SAT perturbs
  the weights, GEP refreshes its public anchor subspace); `after_release(...)` runs after the
  noise and before the update (DP-SAT removes the perturbation there);
- step      `train_step(...)`: forward/backward/step (DP-SAM, with two releases, overrides it);
  every forward/backward of the training loss goes through `_gradient`, the run's precision
  (`per_sample.precision`: autocast, fp16's loss scale and its recomputation).
Every release goes through `_on_release` (Opacus' step hook, called only for real, non-skipped
steps) into the run's PrivacyLedger, so the accountant sees exactly the steps taken.

Accounting convention: a step may answer several Gaussian queries on the same Poisson batch
(DP-SAM's two gradients, GEP's embedding and residual). The ledger records one Poisson-subsampled
Gaussian per step whose noise multiplier is that of the joint query on the concatenated,
sensitivity-normalised vector: `(sum_k (Delta_k / s_k)^2)^(-1/2)` for queries with per-example
L2 sensitivity Delta_k and noise std s_k. For Gaussian queries this joint mechanism is exact
(adaptive composition of Gaussians is a Gaussian with the squared inverse multipliers added),
and Poisson subsampling of it is what the accountant analyses. `releases_per_step` queries at a
common multiplier s give `s / sqrt(releases_per_step)`. `describe_release` states each query's
sensitivity and noise, and the privacy test suite checks them against what the code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.ground.device import Place
from dpadapter.ground.param_schema import param_errors, params_object
from dpadapter.per_sample.optimizers import dp_optimizer
from dpadapter.per_sample.precision import Precision
from dpadapter.privacy import PrivacyLedger, Segment, calibrate_sigma

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


@dataclass(frozen=True)
class Release:
    """One Gaussian query answered on a step's batch.

    `sensitivity` bounds the L2 norm of one example's contribution to the (summed, unscaled)
    query and `noise_std` is the std of the Gaussian noise added to it, in the same units.
    `signal` and `noise` (flattened) are kept only while the algorithm is audited.
    """

    name: str
    sensitivity: float
    noise_std: float
    signal: torch.Tensor | None = None
    noise: torch.Tensor | None = None

    @property
    def inverse_multiplier(self) -> float:
        """Delta / s: the joint multiplier of a step is (sum of squares of these)^(-1/2)."""
        if self.noise_std <= 0:
            return math.inf
        return self.sensitivity / self.noise_std


@dataclass(frozen=True)
class AuditedStep:
    """What one ledger record covers: the multiplier recorded and the queries it answers for."""

    recorded_noise_multiplier: float
    sample_rate: float
    releases: tuple[Release, ...]

    @property
    def joint_noise_multiplier(self) -> float:
        s = sum(r.inverse_multiplier**2 for r in self.releases)
        return 0.0 if math.isinf(s) else (math.inf if s == 0 else s**-0.5)


class DPAlgorithm:
    """DP-SGD (Abadi et al.) with Opacus: per-sample clipping to C, Gaussian noise sigma*C."""

    name: ClassVar[str] = "base"
    mechanism_note: ClassVar[str | None] = None
    # Gaussian queries per step on the same batch, each with the release noise multiplier.
    releases_per_step: ClassVar[int] = 1
    # Whether `set_public_data` must be called before `make_optimizer` (GEP's anchors).
    needs_public_data: ClassVar[bool] = False
    # Whether the algorithm reads per-example gradients itself (not only Opacus' clipped sum):
    # `grad_sample_mode: bk` then runs Opacus' hooks (dpadapter.per_sample).
    needs_per_sample_gradients: ClassVar[bool] = False
    # The Opacus optimizer class of the clip and noise phases (a subclass overrides one of them).
    optimizer_class: ClassVar[type[DPOptimizer]] = DPOptimizer
    # Why a job of several processes (`finetune.processes`) may not run it, or None: it may
    # (the release is summed over the ranks before anything reads it: dpadapter.ground.distributed).
    # Config validation reads it from the catalog and refuses such a job before it starts.
    distributed_refusal: ClassVar[str | None] = None

    # JSON schema of `finetune.algo_params.<name>`: the config validation refuses a typo or a
    # wrong type before any job, and the constructor checks it again.
    params_schema: ClassVar[dict[str, Any]] = params_object()

    def __init__(self, spec: DPRunSpec, ledger: PrivacyLedger, generator: torch.Generator):
        where = f"finetune.algo_params.{self.name}"
        problems = param_errors(self.params_schema, spec.params, where)
        if problems:
            raise ValueError(f"{self.name}: invalid parameters:\n  " + "\n  ".join(problems))
        self.spec = spec
        self.params = {**self.default_params(), **spec.params}
        self.ledger = ledger
        self.generator = generator
        self.sigma = self.calibrate()
        self.optimizer: DPOptimizer | None = None
        # Audit trail (tests, debugging): set to a list to keep every step's releases.
        self.audit: list[AuditedStep] | None = None
        self._pending_releases: list[Release] = []
        self._logical_batch_open = False
        # Set by the stage that trains it: the per-sample mode that ran, and bk's layer plan.
        self.grad_sample_mode: str | None = None
        self.clipping_plan: dict[str, str] = {}
        # Set by the loop (`finetune.precision`); fp32 is the plain forward and backward.
        self.precision = Precision()
        self.per_sample_check: dict | None = None  # the wrap-time self-test's record
        # modules whose statistics DP training froze (per_sample.independence)
        self.frozen_statistics: list[str] = []

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {}

    def param_at_epsilon(self, name: str) -> Any:
        """`params[name]`, or its entry for this run's target epsilon in `<name>_by_epsilon`.

        A table without the run's epsilon falls back to `params[name]`; keys are matched as
        numbers, so YAML's `{1: 0.05}` and JSON's `{"1": 0.05}` mean the same.
        """
        table = self.params.get(f"{name}_by_epsilon") or {}
        for eps, value in table.items():
            if math.isclose(float(eps), self.spec.target_epsilon, rel_tol=1e-9):
                return value
        return self.params[name]

    def set_public_data(self, dataset: torch.utils.data.Dataset) -> None:
        """Public (non-private) examples; only algorithms with `needs_public_data` use them."""

    # --- schedule / calibrate phases -------------------------------------------------------
    def calibrate(self) -> float:
        """Accounted noise multiplier (per step, joint over the step's releases)."""
        s = self.spec
        return calibrate_sigma(
            s.target_epsilon,
            s.delta,
            s.sample_rate,
            s.total_steps,
            s.accountant,
            s.calibration_cache,
        )

    def noise_multiplier(self, epoch: int) -> float:
        """Accounted sigma of the steps of `epoch`."""
        return self.sigma

    def planned_history(self) -> list[Segment]:
        """The releases a run of the spec records if it runs to its end, as the ledger merges
        them: what the calibration promised to keep within the target, and what `dp_fit`
        verifies before the first step. A partial last epoch (a step budget) is cut short."""
        s = self.spec
        plan = PrivacyLedger(s.delta, s.accountant)
        steps, per_epoch = s.total_steps, s.steps_per_epoch
        for epoch in range(math.ceil(steps / per_epoch)):
            n = min(per_epoch, steps - epoch * per_epoch)
            plan.record(self.noise_multiplier(epoch), s.sample_rate, n)
        return plan.history

    def release_noise_multiplier(self, accounted: float) -> float:
        """Multiplier of each of the step's queries so that their joint one is `accounted`."""
        if self.releases_per_step == 1:
            return accounted
        return accounted * math.sqrt(self.releases_per_step)

    def accounted_noise_multiplier(self, opt: DPOptimizer) -> float:
        """What the ledger records for a step made by `opt` (inverse of the above)."""
        if self.releases_per_step == 1:
            return opt.noise_multiplier
        return opt.noise_multiplier / math.sqrt(self.releases_per_step)

    # --- optimizer phase (clip + noise) ------------------------------------------------------
    def make_optimizer(self, optimizer: torch.optim.Optimizer, wrapped: nn.Module) -> DPOptimizer:
        """The clip and noise phases: `optimizer_class`, clipping the way `wrapped` (from
        `per_sample.wrap_for_dp`) records gradients (`per_sample.dp_optimizer`)."""
        opt = self._new_optimizer(
            self.optimizer_class,
            wrapped,
            optimizer,
            noise_multiplier=self.release_noise_multiplier(self.noise_multiplier(0)),
            max_grad_norm=self.spec.max_grad_norm,
            expected_batch_size=self.spec.expected_batch_size,
            loss_reduction="mean",
            generator=self.generator,
        )
        return self._attach(opt)

    def _new_optimizer(
        self, cls: type[DPOptimizer], wrapped: nn.Module, *args: Any, **kwargs: Any
    ) -> DPOptimizer:
        """`cls(*args, **kwargs)` behind the clip of `wrapped`'s per-sample mode."""
        return dp_optimizer(cls, wrapped, *args, precision=self.precision, **kwargs)

    def _attach(self, opt: DPOptimizer) -> DPOptimizer:
        opt.attach_step_hook(self._on_release)
        self.optimizer = opt
        return opt

    def _on_release(self, opt: DPOptimizer) -> None:
        sigma = self.accounted_noise_multiplier(opt)
        self.ledger.record(sigma, self.spec.sample_rate, 1)
        if self.audit is not None:
            releases = (*self._pending_releases, *self.describe_release(opt))
            self.audit.append(AuditedStep(sigma, self.spec.sample_rate, releases))
        self._pending_releases = []
        self._logical_batch_open = False
        self.after_release(opt)

    def describe_release(self, opt: DPOptimizer) -> list[Release]:
        """The Gaussian queries the optimizer just answered (called from the step hook)."""
        return [self._gradient_release("gradient", opt, opt.noise_multiplier)]

    def _gradient_release(self, name: str, opt: DPOptimizer, multiplier: float) -> Release:
        """Opacus' clipped sum (p.summed_grad) and the noise in p.grad, right after scale_grad."""
        c = float(opt.max_grad_norm)
        if self.audit is None:
            return Release(name, c, multiplier * c)
        scale = opt.expected_batch_size * opt.accumulated_iterations
        signal = torch.cat([p.summed_grad.reshape(-1) for p in opt.params]).detach().clone()
        released = torch.cat([p.grad.reshape(-1) * scale for p in opt.params]).detach()
        return Release(name, c, multiplier * c, signal, released - signal)

    def after_release(self, opt: DPOptimizer) -> None:
        """After the noise, before the update (the step hook's tail); DP-SAT restores here."""

    def start_epoch(self, epoch: int) -> None:
        assert self.optimizer is not None
        self.optimizer.noise_multiplier = self.release_noise_multiplier(
            self.noise_multiplier(epoch)
        )

    # --- step phase ----------------------------------------------------------------------------
    def _ends_logical_batch(self) -> bool:
        """Whether the coming optimizer step releases.

        BatchMemoryManager queues each physical batch's skip flag before yielding the batch, so
        the head of Opacus' queue belongs to the batch being processed (Opacus has no public
        accessor for it). Without virtual batches the queue is empty: every step releases.
        """
        assert self.optimizer is not None
        return not self.optimizer._check_skip_next_step(pop_next=False)

    def before_gradient(self, model: nn.Module, loss_fn, first: bool) -> None:
        """Runs before each physical batch's gradient; `first`: opens a logical batch."""

    def train_step(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn
    ) -> torch.Tensor | float:
        """One physical batch; the optimizer skips the update until the logical batch ends.
        Returns the batch's loss as a detached tensor where the step ran (reading its value
        would make a GPU wait for it at every step: `dp_fit` sums it on the device) and 0.0
        for an empty batch."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        first = not self._logical_batch_open
        self._logical_batch_open = True
        self.before_gradient(model, loss_fn, first)
        if len(y) == 0:
            return self.empty_step(model)
        loss = self._gradient(model, x, y, loss_fn)
        self.optimizer.step()
        return loss.detach()

    def _gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn):
        """Forward and backward of the training loss on one physical batch (returns the loss)
        in the run's precision; clipping and noise stay outside, in fp32."""
        return self.precision.gradient(model, x, y, loss_fn)

    def empty_step(self, model: nn.Module) -> float:
        """A Poisson batch can be empty: the release still happens (noise only), as accounted."""
        assert self.optimizer is not None
        self._set_empty_grad_samples()
        self.optimizer.step()
        return 0.0

    def _set_empty_grad_samples(self) -> None:
        assert self.optimizer is not None
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)

    def state_dict(self) -> dict[str, Any]:
        # fp16's loss scale (nothing in fp32/bf16): a resumed run scales as the uninterrupted one
        return {"sigma": self.sigma, **self.precision.state_dict()}

    def load_state_dict(
        self,
        state: dict[str, Any],
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Restore `state`; its tensors go to the parameters' `device` and (floating ones)
        `dtype`, since the stage reads resume states onto the CPU (dpadapter.ground.device.onto)."""
        self.sigma = state["sigma"]
        self.precision.load_state_dict(state)
        self.restore(state, Place(device, dtype))

    def restore(self, state: dict[str, Any], place: Place) -> None:
        """A variant's own part of `state` (what its `state_dict` added), placed by `place`."""

    def epoch_stats(self) -> dict[str, float]:
        """What the algorithm adapted during training, logged with each epoch's stats (only
        values computed from its releases, so publishing them costs no privacy)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Hyperparameters for metrics.json and MLflow (`noise_multiplier`: the accounted one)."""
        out = {"algorithm": self.name, "noise_multiplier": self.sigma, **self.params}
        if self.releases_per_step > 1:
            out["release_noise_multiplier"] = self.release_noise_multiplier(self.sigma)
        # precision, and under fp16 the loss scale's settings (never its data-dependent course)
        return {**out, **self.precision.describe()}


def param_copies(opt: DPOptimizer) -> list[torch.Tensor]:
    """Detached copies of the optimizer's parameters, in Opacus' order."""
    return [p.detach().clone() for p in opt.params]


def all_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of the optimizer, trained now or not (Opacus' `params` keeps only those
    with requires_grad, a set that strategies such as UT change between logical batches)."""
    return [p for group in opt.param_groups for p in group["params"]]


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
