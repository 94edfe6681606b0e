"""Noise-robust pre-training: vanilla SAM/AMP (`sam`) and DPAdapter (`dpadapter`, Algorithm 1).

Both continue from the shared warm-up checkpoint (Step 1 of the paper is that warm-up) and differ
only in which batch defines the worst-case weight perturbation Delta:

* `sam` (the paper's "vanilla SAM", AMP with one ascent step): Delta comes from the same
  mini-batch that is then used for the update, as in every SAM variant the paper compares with.
* `dpadapter`: every iteration draws a large batch B1 (m1 examples) for Delta and, independently,
  a small batch B2 (m2 examples) for the update. Decoupling them is the paper's contribution
  (Section 4.2): a large B1 gives an accurate perturbation, a small B2 a good SGD step.

One iteration (Algorithm 1, lines 2-12): Delta = eta1 * grad L_B1(theta); if ||Delta||_2 > gamma
(norm over all parameters together) rescale it to norm gamma; take the gradient of L_B2 at
theta + Delta; return to theta; apply the SGD step (momentum, weight decay, step LR) with that
gradient. Returning to theta is done by restoring a saved copy rather than subtracting Delta, so
the revert is exact in floating point and gamma = 0 reproduces standard training bit for bit.
The one place this differs from a literal reading of lines 11-12 is weight decay: it acts on theta,
the weights that are kept, not on theta + Delta (a difference of lr * weight_decay * Delta per
step, 2e-5 in norm with the paper's values), which is also what SAM implementations do.
With gamma = 0 the B1 pass is skipped (Delta is 0 whatever the gradient), which makes `dpadapter`
with gamma = 0 the compute-blind control: standard SGD continued from the warm-up with the same
batches, schedule and number of steps.

An "epoch" is one pass of B2 mini-batches over the public training set (shuffled without
replacement, the loop every upstream method shares), so `epochs`, `milestones` and `max_steps`
mean the same thing as for the warm-up. B1 is drawn uniformly without replacement from the whole
public training set by a generator of its own, so it never depends on the B2 stream.

Paper defaults (Section 5.1, CIFAR-100 -> ResNet-20), which `default_params()` returns:

==============  =====================================================  ==========
parameter       meaning                                                paper
==============  =====================================================  ==========
epochs          passes of B2 over the public set (K)                   1000
lr              update learning rate eta2                              0.1
milestones      epochs after which lr is multiplied by lr_gamma        500, 750
lr_gamma        step-LR factor                                         0.1
momentum        SGD momentum                                           0.9
weight_decay    SGD weight decay                                       1e-4
m1              perturbation batch size |B1| (dpadapter)               5000
m2              update batch size |B2| (dpadapter)                     50
m               shared batch size (sam)                                100
eta1            perturbation step (inner learning rate)                1.0
gamma           radius of the L2 ball on Delta                         2.0 (sam: 1.0)
==============  =====================================================  ==========

The paper does not give SAM's eta1 or schedule; they are assumed equal to DPAdapter's so the two
differ only in the batch choice. Parameters of this implementation, not of the paper:
`chunk_size` (examples per forward/backward when computing grad L_B1, which bounds memory by the
chunk rather than by m1; the gradient is the same; halved on out-of-memory until it fits, see
`PerturbedStep._gradient`), `refresh_every` (dpadapter only; k: recompute
Delta every k steps and reuse it, still capped and reverted, in between; k = 1 is Algorithm 1,
larger k divides the perturbation cost by k, but SGD then learns to offset a fixed Delta, which
moves the clean weights away by about Delta: see bench/dpadapter_cost.py) and `max_steps` (stop
after this many updates in total; the paper's schedule is far beyond a CPU budget, so the
embedded setting runs a fraction of an epoch).

On the embedded default (Fashion-MNIST, 26k public images, small CNN, 2 CPU cores) one exact
DPAdapter epoch with m1 = 1024, m2 = 64 costs about 17 standard epochs (measured 14-17x), so the
embedded setting uses m1 = 1024, m2 = 64, eta1 = 1, gamma = 0.5, lr = 0.01 and max_steps = 200
(half an epoch): about a minute on an idle machine, +4 points of public robust accuracy for -1
point of accuracy.

Per-epoch statistics go to `ctx.log_epoch`: `train_loss` (B2 loss at theta + Delta),
`b1_loss` (clean loss at theta on the perturbation batch), `delta_norm_raw` (||eta1 grad||
before the cap), `delta_norm` (applied), `gamma_binding` (fraction of computed perturbations
that the cap shortened), `refreshes` and `b1_chunk_size` (the chunk the B1 pass used).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.config import SGDConfig
from dpadapter.device import gather, onto, to
from dpadapter.param_schema import (
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    nullable,
    params_object,
)
from dpadapter.train.loops import sgd_train
from dpadapter.upstream.base import UpstreamContext, UpstreamMethod, register_upstream

# The seed of the B1 sampler is derived from the run seed and this label, so B1 never shares a
# random stream with the B2 loader (which is seeded with the run seed itself).
_B1_STREAM = "dpadapter.B1"


def derived_seed(seed: int, label: str) -> int:
    """A stable (process-independent, unlike hash()) 63-bit seed for a named random stream."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(label.encode())) % (2**63 - 1)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """L2 norm over all tensors together: the norm the gamma ball is defined in (Eq. 1)."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([t.detach().norm(2) for t in tensors])))


def _chunks(
    x: torch.Tensor,
    y: torch.Tensor,
    index: torch.Tensor | None,
    chunk_size: int,
    device: torch.device,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Slices of the batch on `device`; with `index` the rows are gathered per chunk, never
    all at once. A public set too large for the GPU stays in pinned host memory
    (`dpadapter.device.place`): each chunk is gathered there and copied to the model."""
    n = len(y) if index is None else len(index)
    for start in range(0, n, chunk_size):
        if index is None:
            yield (
                to(x[start : start + chunk_size], device),
                to(y[start : start + chunk_size], device),
            )
        else:
            rows = index[start : start + chunk_size]
            yield gather(x, rows, device), gather(y, rows, device)


def batch_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    chunk_size: int,
    index: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], float]:
    """Gradient of the mean cross-entropy over a batch, accumulated chunk by chunk.

    Each chunk contributes sum-loss / n, so the total is the full-batch mean gradient while only
    one chunk's activations are alive at a time. `torch.autograd.grad` leaves `.grad` alone, so
    the optimizer's gradient buffers are never polluted by the perturbation batch. Returns the
    gradient (one tensor per trainable parameter) and the mean loss.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    params = trainable(model)
    n = len(y) if index is None else len(index)
    if n == 0:
        raise ValueError("empty perturbation batch")
    grads = [torch.zeros_like(p) for p in params]
    total = 0.0
    for xc, yc in _chunks(x, y, index, chunk_size, params[0].device):
        loss = nn.functional.cross_entropy(model(xc), yc, reduction="sum") / n
        for acc, g in zip(grads, torch.autograd.grad(loss, params), strict=True):
            acc.add_(g)
        total += float(loss.detach())
    return grads, total


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; other backends (MPS, XPU, some cuDNN paths) a plain
    RuntimeError whose message says "out of memory"."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def release_cached_memory(device: torch.device) -> None:
    """Hand the allocator's cached blocks back, so that the smaller chunk finds them free.

    Called once nothing references the failed chunk any more; the collection frees tensors
    kept alive only by reference cycles (autograd graphs of the failed forward).
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cap_to_ball(delta: list[torch.Tensor], gamma: float) -> tuple[list[torch.Tensor], float, bool]:
    """Algorithm 1 lines 6-8: shrink Delta onto the gamma ball if it lies outside.

    Returns (Delta, norm before the cap, whether the cap was binding).
    """
    raw = global_norm(delta)
    if raw > gamma:
        scale = gamma / raw
        delta = [d * scale for d in delta]
        return delta, raw, True
    return delta, raw, False


@dataclass
class _EpochStats:
    """Running sums over one epoch, reset after each `log_epoch` call."""

    refreshes: int = 0
    binding: int = 0
    raw_norm: float = 0.0
    norm: float = 0.0
    b1_loss: float = 0.0
    b1_batches: int = 0

    def summary(self) -> dict[str, float]:
        r = max(1, self.refreshes)
        out = {
            "refreshes": self.refreshes,
            "gamma_binding": self.binding / r,
            "delta_norm_raw": self.raw_norm / r,
            "delta_norm": self.norm / r,
        }
        if self.b1_batches:  # none with gamma = 0, where no perturbation gradient is computed
            out["b1_loss"] = self.b1_loss / self.b1_batches
        return out


class B1Sampler:
    """Uniform draws of m1 distinct training indices from a generator no other sampler uses."""

    def __init__(self, n: int, m1: int, seed: int):
        if m1 < 1:
            raise ValueError("m1 must be >= 1")
        self.n = n
        self.m1 = min(m1, n)  # m1 >= n means the full public set: the paper's ideal (Sec. 4.2)
        self.generator = torch.Generator().manual_seed(derived_seed(seed, _B1_STREAM))

    def draw(self) -> torch.Tensor:
        return torch.randperm(self.n, generator=self.generator)[: self.m1]


class PerturbedStep:
    """A `StepFn` for `sgd_train`: perturb by Delta, take the gradient there, restore, step.

    With `sampler=None` Delta comes from the update batch itself (SAM/AMP); otherwise from an
    independent B1 of the training set (DPAdapter). `last_delta` and `last_b1` are kept for
    inspection (tests, logging); they are the tensors applied, not copies of anything else.
    """

    def __init__(
        self,
        data: TensorDataset,
        eta1: float,
        gamma: float,
        chunk_size: int,
        refresh_every: int = 1,
        sampler: B1Sampler | None = None,
    ):
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        if refresh_every < 1:
            raise ValueError("refresh_every must be >= 1")
        self.x_all, self.y_all = data.tensors
        self.eta1 = float(eta1)
        self.gamma = float(gamma)
        self.chunk_size = int(chunk_size)
        self.refresh_every = int(refresh_every)
        self.sampler = sampler
        self.steps = 0
        self.last_delta: list[torch.Tensor] | None = None
        self.last_b1: torch.Tensor | None = None
        self._raw: list[torch.Tensor] = []  # the last B1 gradient, before eta1 and the cap
        self.stats = _EpochStats()

    def _gradient(self, model: nn.Module, x, y, index) -> tuple[list[torch.Tensor], float]:
        """The B1 gradient in chunks of at most `chunk_size`, halved on out-of-memory.

        `chunk_size` is an upper bound: on a device that cannot hold a chunk's activations the
        chunk halves until it fits, and stays at that size for the rest of the run (it is in
        the resume state and in each epoch's `b1_chunk_size`). The gradient is the same
        whatever the chunk (the loss is a sum over chunks), and a failed attempt leaves no
        trace in it: each attempt accumulates from zero.
        """
        while True:
            try:
                return batch_gradient(model, x, y, self.chunk_size, index=index)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc):
                    raise
                failed = self.chunk_size
            # Out of the except block: the exception's traceback, which holds the failed
            # chunk's inputs and activations, is gone before the cached memory is released.
            if failed <= 1:
                raise RuntimeError(
                    "DPAdapter B1 gradient: out of memory with one example per chunk; the model "
                    "does not fit the device (use a smaller model, or device: cpu)"
                )
            self.chunk_size = max(1, failed // 2)
            model.zero_grad(set_to_none=True)
            release_cached_memory(next(model.parameters()).device)
            print(f"B1 gradient: out of memory at chunk_size {failed}, now {self.chunk_size}")

    def _perturbation(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        s = self.stats
        s.refreshes += 1
        if self.gamma == 0:
            # The ball has radius 0, so Delta = 0 whatever the gradient: skip the B1 pass. This
            # makes gamma = 0 a cheap control (standard SGD on B2 batches for the same steps).
            self.last_b1 = None
            self.last_delta = [torch.zeros_like(p) for p in trainable(model)]
            return
        if self.sampler is None:
            self.last_b1 = None
            grads, loss = self._gradient(model, x, y, None)
        else:
            self.last_b1 = self.sampler.draw()
            grads, loss = self._gradient(model, self.x_all, self.y_all, self.last_b1)
        self._raw = grads
        delta, raw, binding = cap_to_ball([self.eta1 * g for g in grads], self.gamma)
        self.last_delta = delta
        s.binding += int(binding)
        s.raw_norm += raw
        s.norm += min(raw, self.gamma)
        s.b1_loss += loss
        s.b1_batches += 1

    def before_update(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Runs at theta after Delta is set and before the perturbed gradient (EMA variant)."""

    def __call__(
        self, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> float:
        if self.last_delta is None or self.steps % self.refresh_every == 0:
            self._perturbation(model, x, y)
        assert self.last_delta is not None
        self.steps += 1
        self.before_update(model, x, y)
        params = trainable(model)
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, d in zip(params, self.last_delta, strict=True):
                p.add_(d)
        opt.zero_grad(set_to_none=True)
        try:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
        opt.step()
        return float(loss.detach())

    def pop_epoch_stats(self) -> dict[str, float]:
        out = self.stats.summary()
        if "b1_loss" in out:  # the chunk the perturbation gradient used (after any halving)
            out["b1_chunk_size"] = self.chunk_size
        self.stats = _EpochStats()
        return out

    def state_dict(self) -> dict[str, Any]:
        """What `sgd_train` saves to resume exactly: the step count (when Delta is refreshed),
        the Delta in use (reused across steps, and epochs, when refresh_every > 1), the B1
        sampler's generator and this epoch's running statistics."""
        return {
            "steps": self.steps,
            "last_delta": None
            if self.last_delta is None
            else [d.detach().cpu() for d in self.last_delta],
            "last_b1": None if self.last_b1 is None else self.last_b1.cpu(),
            "sampler_rng": None if self.sampler is None else self.sampler.generator.get_state(),
            "stats": dataclasses.asdict(self.stats),
            "chunk_size": self.chunk_size,  # a halved chunk stays halved after a resume
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Delta goes to the parameters' device and dtype (it is added to them); B1's indices
        stay on the CPU, where the sampler draws them."""
        self.steps = int(state["steps"])
        self.chunk_size = min(self.chunk_size, int(state.get("chunk_size", self.chunk_size)))
        delta = state["last_delta"]
        self.last_delta = None if delta is None else [onto(d, device, dtype) for d in delta]
        self.last_b1 = state["last_b1"]
        if self.sampler is not None and state["sampler_rng"] is not None:
            self.sampler.generator.set_state(state["sampler_rng"])
        self.stats = _EpochStats(**state["stats"])


class EMAPerturbedStep(PerturbedStep):
    """DPAdapter's cheaper option (`ema_beta`): Delta from a running average of clean gradients.

    Algorithm 1's cost is the B1 pass: m1 / m2 update batches' worth of work per step (16x in
    the embedded setting, 100x in the paper's). This variant replaces grad L_B1(theta_t) by
    an exponential moving average of the clean gradients grad L_B2(theta_s) of the steps s < t,
    each taken at the unperturbed weights on that step's update batch, so a step costs two
    passes over B2 (about 2x a standard step) instead of (m1 + m2) / m2.

    Why it should approximate Algorithm 1: with beta = (m1 - m2) / (m1 + m2), an average of
    independent B2 gradients has the variance of one B1 gradient (its effective batch is
    m2 (1 + beta) / (1 - beta) = m1). It is built only from earlier batches, so Delta stays
    independent of the update batch, as B1 is (the paper's decoupling). It starts from one exact
    B1 gradient, so the first steps are Algorithm 1's. What it gives up: the average lags theta
    by about 1 / (1 - beta) steps, so it is the gradient at slightly stale weights. Unlike a
    Delta reused for k steps (`refresh_every`, which failed: SGD learns to offset a fixed
    Delta), it changes every step and follows theta. Whether that is close enough is measured,
    not assumed (bench/dpadapter_cost.py, docs/speed.md).
    """

    def __init__(self, *args: Any, beta: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not 0 <= beta < 1:
            raise ValueError("ema_beta must be in [0, 1)")
        if self.refresh_every != 1:
            raise ValueError(
                "ema_beta needs refresh_every = 1 (the average is refreshed each step)"
            )
        self.beta = float(beta)
        self.average: list[torch.Tensor] | None = None

    def _perturbation(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.average is None or self.gamma == 0:
            super()._perturbation(model, x, y)  # the exact B1 gradient starts the average
            if self.gamma != 0:
                self.average = [g.clone() for g in self._raw]
            return
        s = self.stats
        s.refreshes += 1
        delta, raw, binding = cap_to_ball([self.eta1 * g for g in self.average], self.gamma)
        self.last_delta = delta
        s.binding += int(binding)
        s.raw_norm += raw
        s.norm += min(raw, self.gamma)

    def before_update(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.average is None:
            return
        params = trainable(model)
        loss = nn.functional.cross_entropy(model(x), y)
        with torch.no_grad():
            for a, g in zip(self.average, torch.autograd.grad(loss, params), strict=True):
                a.mul_(self.beta).add_(g, alpha=1 - self.beta)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["average"] = None if self.average is None else [a.cpu() for a in self.average]
        return out

    def load_state_dict(
        self,
        state: dict[str, Any],
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().load_state_dict(state, device, dtype)
        avg = state.get("average")
        self.average = None if avg is None else [onto(a, device, dtype) for a in avg]


_SCHEDULE_DEFAULTS: dict[str, Any] = {
    "epochs": 1000,
    "lr": 0.1,
    "milestones": [500, 750],
    "lr_gamma": 0.1,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "eta1": 1.0,
    "chunk_size": 1000,
    "max_steps": None,
    "schedule_unit": "epochs",
}
# Types and ranges of the schedule params, shared by SAM and DPAdapter (each declares its own).
_SCHEDULE_SCHEMA: dict[str, dict[str, Any]] = {
    "epochs": NON_NEGATIVE_INT,
    "lr": NON_NEGATIVE,  # 0 is allowed: tests check that a step at lr 0 reverts exactly
    "milestones": {"type": "array", "items": POSITIVE_INT},
    "lr_gamma": POSITIVE,
    "momentum": FRACTION,
    "weight_decay": NON_NEGATIVE,
    "eta1": NON_NEGATIVE,
    "chunk_size": POSITIVE_INT,
    "max_steps": nullable(POSITIVE_INT),
    "schedule_unit": {"enum": ["epochs", "steps"]},
}


class _PerturbedUpstream(UpstreamMethod):
    """Shared build: copy the warm-up model, train it with a `PerturbedStep`, log each epoch."""

    needs_warmup = True
    needs_public_data = True

    def update_batch_size(self) -> int:
        raise NotImplementedError

    def make_step(self, data: TensorDataset, seed: int) -> PerturbedStep:
        raise NotImplementedError

    def sgd_config(self) -> SGDConfig:
        p = self.params
        return SGDConfig(
            epochs=int(p["epochs"]),
            batch_size=self.update_batch_size(),
            lr=float(p["lr"]),
            momentum=float(p["momentum"]),
            weight_decay=float(p["weight_decay"]),
            milestones=tuple(int(m) for m in p["milestones"]),
            lr_gamma=float(p["lr_gamma"]),
            max_steps=None if p["max_steps"] is None else int(p["max_steps"]),
            schedule_unit=str(p["schedule_unit"]),
        )

    def train(self, model: nn.Module, ctx: UpstreamContext) -> tuple[nn.Module, PerturbedStep]:
        """Train `model` in place; separate from `build` so tests can drive it without a ctx."""
        assert ctx.public is not None
        data = ctx.public.train
        step = self.make_step(data, ctx.seed)

        def on_epoch(epoch: int, stats: dict) -> None:
            ctx.log_epoch(epoch, {**stats, **step.pop_epoch_stats()})

        sgd_train(
            model,
            data,
            self.sgd_config(),
            seed=ctx.seed,
            step=step,
            on_epoch=on_epoch,
            desc=self.name,
            resume=ctx.resume,
            val=ctx.public.val,
        )
        return model, step

    def build(self, ctx: UpstreamContext) -> nn.Module:
        if ctx.warmup_model is None:
            raise ValueError(f"{self.name} continues from the warm-up model; none was given")
        # A copy, so that one loaded warm-up model can seed several methods in one process.
        model = copy.deepcopy(ctx.warmup_model)
        model.train()
        return self.train(model, ctx)[0]


@register_upstream("sam")
class SAM(_PerturbedUpstream):
    """Vanilla SAM / AMP baseline: Delta and the update come from the same batch of size m."""

    params_schema = params_object(**_SCHEDULE_SCHEMA, m=POSITIVE_INT, gamma=NON_NEGATIVE)

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        # No refresh_every: reusing Delta would take it from an earlier batch, which is no longer
        # the same-batch baseline this method stands for.
        return {**_SCHEDULE_DEFAULTS, "m": 100, "gamma": 1.0}

    def update_batch_size(self) -> int:
        return int(self.params["m"])

    def make_step(self, data: TensorDataset, seed: int) -> PerturbedStep:
        p = self.params
        return PerturbedStep(data, p["eta1"], p["gamma"], p["chunk_size"])


@register_upstream("dpadapter")
class DPAdapter(_PerturbedUpstream):
    """Algorithm 1: Delta from an independent large batch B1, the update from a small B2."""

    params_schema = params_object(
        **_SCHEDULE_SCHEMA,
        m1=POSITIVE_INT,
        m2=POSITIVE_INT,
        gamma=NON_NEGATIVE,
        refresh_every=POSITIVE_INT,
        ema_beta={
            "oneOf": [
                {"type": "null"},
                {"const": "auto"},
                {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            ]
        },
    )

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        # ema_beta None: exact Algorithm 1 (the paper configs' setting); a number, or "auto" for
        # (m1 - m2) / (m1 + m2): the EMAPerturbedStep option (`dpadapter-ema`).
        return {
            **_SCHEDULE_DEFAULTS,
            "m1": 5000,
            "m2": 50,
            "gamma": 2.0,
            "refresh_every": 1,
            "ema_beta": None,
        }

    def update_batch_size(self) -> int:
        return int(self.params["m2"])

    def make_step(self, data: TensorDataset, seed: int) -> PerturbedStep:
        p = self.params
        sampler = B1Sampler(len(data), int(p["m1"]), seed)
        args = (data, p["eta1"], p["gamma"], p["chunk_size"], p["refresh_every"])
        beta = p["ema_beta"]
        if beta == "auto":
            beta = (int(p["m1"]) - int(p["m2"])) / (int(p["m1"]) + int(p["m2"]))
        if beta is not None:
            return EMAPerturbedStep(*args, sampler=sampler, beta=float(beta))
        return PerturbedStep(*args, sampler=sampler)


@register_upstream("dpadapter-ema")
class DPAdapterEMA(DPAdapter):
    """DPAdapter with the cheaper perturbation (EMAPerturbedStep): `ema_beta` "auto" by default,
    so the running average has the variance of one B1 gradient. About 2x a standard step."""

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {**super().default_params(), "ema_beta": "auto"}


def relative_step_cost(m1: int, m2: int, refresh_every: int = 1) -> float:
    """Examples processed per DPAdapter step over those of a standard step with batch m2.

    The forward/backward over B1 costs m1 example-passes every `refresh_every` steps; the update
    costs m2. Ignores the parameter copy and restore, which are negligible for conv nets.
    """
    return (m1 / refresh_every + m2) / m2 if m2 > 0 else math.inf
