"""The training step SAM (`upstream.sam`) and DPAdapter (`upstream.dpadapter`) share.

Both continue from the shared warm-up checkpoint and differ only in which batch defines the
weight perturbation Delta, so one step serves both: `PerturbedStep` with `sampler=None` takes
Delta from the update batch (SAM), with a `B1Sampler` from an independent batch B1 (DPAdapter).
Comments "Alg. 1 line N" name the line of the DPAdapter paper's Algorithm 1 each piece carries
out; for SAM read B1 as the update batch itself.

One step: Delta = eta1 * grad L_B1(theta); if ||Delta||_2 > gamma (norm over all parameters
together) rescale it to norm gamma; take the gradient of L_B2 at theta + Delta; return to theta;
apply the SGD step (momentum, weight decay, step LR) with that gradient. Returning to theta is
done by restoring a saved copy rather than subtracting Delta, so the revert is exact in floating
point and gamma = 0 reproduces standard training bit for bit. The one place this differs from a
literal reading of Algorithm 1, lines 11-12, is weight decay: it acts on theta, the weights that
are kept, not on theta + Delta (a difference of lr * weight_decay * Delta per step, 2e-5 in norm
with the paper's values), which is also what SAM implementations do. With gamma = 0 the B1 pass
is skipped (Delta is 0 whatever the gradient), which makes `dpadapter` with gamma = 0 the
compute-blind control: standard SGD continued from the warm-up with the same batches, schedule
and number of steps.

An "epoch" is one pass of update mini-batches over the public training set (shuffled without
replacement, the loop every upstream method shares), so `epochs`, `milestones` and `max_steps`
mean the same thing as for the warm-up. B1 is drawn uniformly without replacement from the whole
public training set by a generator of its own, so it never depends on the update-batch stream.

Schedule parameters both methods take (`SCHEDULE_DEFAULTS`, the paper's values, Section 5.1,
CIFAR-100 -> ResNet-20; the paper does not give SAM's, so SAM is assumed to share them):

==============  =====================================================  ==========
parameter       meaning                                                paper
==============  =====================================================  ==========
epochs          passes of the update batches over the public set (K)   1000
lr              update learning rate eta2                              0.1
milestones      epochs after which lr is multiplied by lr_gamma        500, 750
lr_gamma        step-LR factor                                         0.1
momentum        SGD momentum                                           0.9
weight_decay    SGD weight decay                                       1e-4
eta1            perturbation step (inner learning rate)                1.0
==============  =====================================================  ==========

Parameters of this implementation, not of the paper: `chunk_size` (examples per forward/backward
when computing grad L_B1, which bounds memory by the chunk rather than by m1; the gradient is the
same; halved on out-of-memory until it fits, see `PerturbedStep._gradient`) and `max_steps` (stop
after this many updates in total; the paper's schedule is far beyond a CPU budget, so the
embedded setting runs a fraction of an epoch).

Per-epoch statistics go to `ctx.log_epoch`: `train_loss` (update-batch loss at theta + Delta),
`b1_loss` (clean loss at theta on the perturbation batch), `delta_norm_raw` (||eta1 grad||
before the cap), `delta_norm` (applied), `gamma_binding` (fraction of computed perturbations
that the cap shortened), `refreshes` and `b1_chunk_size` (the chunk the B1 pass used).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.ground import distributed
from dpadapter.ground.device import Place, gather, to
from dpadapter.ground.param_schema import (
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    nullable,
)
from dpadapter.settings import SGDConfig
from dpadapter.train.loops import mean_loss_backward, sgd_train
from dpadapter.upstream.base import UpstreamContext, UpstreamMethod

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
    (`dpadapter.ground.device.place`): each chunk is gathered there and copied to the model."""
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
    # A job of several processes (pretrain.processes): every rank drew the same batch; each
    # takes its rows r, r + k, ... and the parts (sums over its rows / n) are summed over the
    # ranks: the same full-batch mean gradient, computed k times faster.
    w = distributed.world()
    if w.multi and index is None:
        x, y = x[w.rank :: w.size], y[w.rank :: w.size]
    elif w.multi:
        index = index[w.rank :: w.size]
    grads = [torch.zeros_like(p) for p in params]
    total = 0.0
    for xc, yc in _chunks(x, y, index, chunk_size, params[0].device):
        loss = nn.functional.cross_entropy(model(xc), yc, reduction="sum") / n
        for acc, g in zip(grads, torch.autograd.grad(loss, params), strict=True):
            acc.add_(g)
        total += float(loss.detach())
    if w.multi:
        distributed.all_reduce_sum(grads)
        summed = torch.tensor([total], dtype=torch.float64, device=grads[0].device)
        distributed.all_reduce_sum([summed])
        total = float(summed)
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
            # Alg. 1 line 4 (Delta = 0) is all there is: the ball has radius 0, so Delta = 0
            # whatever the gradient; skip the B1 pass. This makes gamma = 0 a cheap control
            # (standard SGD on B2 batches for the same steps).
            self.last_b1 = None
            self.last_delta = [torch.zeros_like(p) for p in trainable(model)]
            return
        if self.sampler is None:  # SAM: the update batch is the perturbation batch
            self.last_b1 = None
            grads, loss = self._gradient(model, x, y, None)
        else:
            self.last_b1 = self.sampler.draw()  # Alg. 1 line 2: draw B1
            grads, loss = self._gradient(model, self.x_all, self.y_all, self.last_b1)
        self._raw = grads
        # Alg. 1 line 5: the argmax over the ball by one ascent step, eta1 * grad L_B1(theta);
        # lines 6-8: shrink it onto the gamma ball.
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
        """One iteration of Algorithm 1 on the update batch (x, y) = B2 (line 3, drawn by
        `sgd_train`'s loader, which also runs lines 1 and 13)."""
        if self.last_delta is None or self.steps % self.refresh_every == 0:
            self._perturbation(model, x, y)
        assert self.last_delta is not None
        self.steps += 1
        self.before_update(model, x, y)
        params = trainable(model)
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, d in zip(params, self.last_delta, strict=True):
                p.add_(d)  # Alg. 1 line 9: theta + Delta
        opt.zero_grad(set_to_none=True)
        try:
            loss = mean_loss_backward(model, x, y)  # Alg. 1 line 10: grad L_B2 at theta + Delta
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)  # Alg. 1 line 12: revert (exactly), before the step
        opt.step()  # Alg. 1 line 11: the update, applied to theta (see the module doc)
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
        place = Place(device, dtype)
        self.last_delta = place.all(state["last_delta"])
        self.last_b1 = state["last_b1"]
        if self.sampler is not None and state["sampler_rng"] is not None:
            self.sampler.generator.set_state(state["sampler_rng"])
        self.stats = _EpochStats(**state["stats"])
        self.restore(state, place)

    def restore(self, state: dict[str, Any], place: Place) -> None:
        """A variant's own part of `state` (what its `state_dict` added), placed by `place`."""


SCHEDULE_DEFAULTS: dict[str, Any] = {
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
SCHEDULE_SCHEMA: dict[str, dict[str, Any]] = {
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


class PerturbedUpstream(UpstreamMethod):
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

        # Alg. 1 lines 1 and 13 (the loop over the schedule's iterations) and line 3 (B2: the
        # loader's batches of update_batch_size()); `step` runs lines 4-12 on each batch.
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
