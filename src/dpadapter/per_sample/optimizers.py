"""The DP optimizer's clip, chosen by how the wrapped module records gradients.

An algorithm picks its Opacus optimizer class (DPOptimizer, AdaClip's, GEP's) for its noise
and phases; how per-example gradients are clipped depends on the per-sample mode instead. So,
as Opacus' `get_optimizer_class(clipping, distributed, grad_sample_mode)` does, a factory
(`optimizer_class`) returns the class to construct: the algorithm's class behind one of two
clip mixins, made once per pair and cached:

- `BookKeepingClip` (mode `bk`): the norms and clipped sums from the module's records
  (`bookkeeping`), never from per-example gradients;
- `FP32Clip` (Opacus' modes: hooks, functorch, ew): the class' own clip, with the per-example
  gradients unscaled and cast up first under mixed precision (`precision`).

Both clip in full FP32 (`device.full_fp32`): the norms and the clipped sum come from different
kernels, and under TF32 a clipped example could add ~1e-3 more than C to the sum, i.e. more
than the sensitivity the accountant is told (`bookkeeping`'s docstring). The per-example
gradients themselves may come from TF32 kernels: the bound holds for whatever vector is
clipped, as long as the clip is exact.

In a job of several processes (`dpadapter.ground.distributed`) a third mixin, `DistributedNoise`,
goes
in front: its noise phase adds the noise on rank 0 only and sums the ranks' clipped sums in one
all-reduce before anything reads the release (Opacus' `get_optimizer_class(distributed=True)`
picks its `DistributedDPOptimizer` the same way; that class reduces after the step hook).

`dp_optimizer` constructs one; the class is fixed at construction and never swapped on a live
object.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.ground import distributed
from dpadapter.ground.device import full_fp32
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.clip import clip_factors, folded_rows_error
from dpadapter.privacy.randomness import gaussian_noise

if TYPE_CHECKING:
    from dpadapter.per_sample.precision import Precision


class FP32Clip:
    """Placed before an Opacus optimizer class: its own clip, in full FP32, on per-example
    gradients unscaled and cast up (`precision`, mixed precision) first."""

    def __init__(
        self,
        *args: Any,
        precision: Precision | None = None,
        module: nn.Module | None = None,
        **kwargs: Any,
    ):
        self.precision = precision
        self._dp_module = module  # the wrapped module: its `dp_rows` (opacus_modes._record_rows)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def clip_and_accumulate(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_folded_rows()
        if self.precision is not None:
            self.precision.unscale(self.params)  # type: ignore[attr-defined]
        with full_fp32():
            return super().clip_and_accumulate(*args, **kwargs)  # type: ignore[misc]

    def _refuse_folded_rows(self) -> None:
        """One row per example in every per-example gradient, else refused: a layer fed the
        batch folded with something else gives more rows than examples (each clipped alone)."""
        rows = getattr(self._dp_module, "dp_rows", None)
        if self._dp_module is not None:
            self._dp_module.dp_rows = None  # read once: the next clip needs its own forward
        shapes = [
            tuple(p.grad_sample.shape)
            for p in self.params  # type: ignore[attr-defined]
            if isinstance(getattr(p, "grad_sample", None), torch.Tensor)
        ]
        firsts = {s[0] for s in shapes}
        # an empty Poisson batch's zeros have no forward of their own (and bound nothing)
        if firsts == {0}:
            return
        if len(firsts) > 1 or (rows is not None and firsts - {rows}):
            raise folded_rows_error(
                f"per-example gradients with {sorted(firsts)} rows (shapes "
                f"{sorted(set(shapes))[:6]})",
                rows,
            )


class BookKeepingClip:
    """Placed before an Opacus optimizer class: clipping from the module's records.

    Everything else (noise, scaling, virtual steps, step hooks, AdaClip's count through
    `observe_norms`) is the wrapped class's. Opacus reads `p.grad_sample` only to count
    accumulated physical batches and to spot empty ones; after clipping each parameter holds an
    empty `(n, 0)` marker there instead of its per-example gradients. Under mixed precision the
    module itself divides the loss scale out (`BookKeepingModule.grad_scale`).
    """

    def __init__(self, *args: Any, bookkeeping: BookKeepingModule, **kwargs: Any):
        self.bookkeeping = bookkeeping
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    @property
    def grad_samples(self) -> list[torch.Tensor]:
        n = self.bookkeeping.batch_size()
        if n is None:
            return super().grad_samples  # type: ignore[misc]
        return [_marker(p, n) for p in self.params]  # type: ignore[attr-defined]

    def clip_and_accumulate(self) -> None:
        """Norms, clip factors and clipped sums in full FP32: see the module docstring."""
        with full_fp32():
            self._clip_and_accumulate()

    def _clip_and_accumulate(self) -> None:
        params = self.params  # type: ignore[attr-defined]
        bk = self.bookkeeping
        n = bk.batch_size()
        if n is None:  # an empty Poisson batch: the algorithm set empty per-sample gradients
            for p in params:
                gs = getattr(p, "grad_sample", None)
                if gs is None or len(gs) != 0:
                    raise RuntimeError("grad_sample_mode 'bk': no forward/backward to clip")
            device = params[0].device if params else None
            norms = torch.zeros(0, device=device)
            sums = {id(p): torch.zeros_like(p) for p in params}
        else:
            norms = bk.per_sample_norms(params)
            sums = None
        factor = clip_factors(norms, self.max_grad_norm)  # type: ignore[attr-defined]
        observe = getattr(self, "observe_norms", None)
        if observe is not None:
            observe(norms)
        if sums is None:
            sums = bk.clipped_sums(params, factor)
        for p in params:
            s = sums[id(p)].to(p.dtype)
            prev = getattr(p, "summed_grad", None)
            p.summed_grad = s if prev is None else prev + s
            if getattr(p, "grad_sample", None) is None:
                p.grad_sample = _marker(p, n or 0)
        bk.clear()


class DistributedNoise:
    """Placed before a clip mixin in a multi-process job: the noise phase of the whole job.

    Rank 0 runs the class's own noise phase (one draw of N(0, sigma^2 C^2) per coordinate, from
    the run's noise generator); every other rank releases its clipped sum as it is; one
    all-reduce then gives every rank the global clipped sum plus that one draw. Scaling (by the
    global expected batch size), the step hook and the update follow on equal values.
    """

    def add_noise(self) -> None:
        params = self.params  # type: ignore[attr-defined]
        if distributed.world().rank == 0:
            super().add_noise()  # type: ignore[misc]
        else:
            from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

            for p in params:
                _check_processed_flag(p.summed_grad)
                p.grad = p.summed_grad.clone().view_as(p)
                _mark_as_processed(p.summed_grad)
        distributed.all_reduce_sum([p.grad for p in params])


class FusedRelease(DPOptimizer):
    """Placed after the algorithm's class, so right before Opacus' `DPOptimizer`: its noise and
    scaling phases with one `torch._foreach` call each across the parameters instead of one
    kernel per parameter tensor (the sum with the noise, the division by the expected batch),
    and the noise of all parameters of one dtype and device drawn at once (`flat_noise`).

    The same law: N(0, sigma^2 C^2) i.i.d. per coordinate from the run's generator (the OS for a
    secret one, `privacy.randomness`), as Opacus' one draw per tensor; a seeded run draws other
    values than Opacus' per-tensor order would (docs/validity.md), the sums and divisions are the
    same elementwise IEEE operations. An algorithm with a noise phase of its own (GEP, AdpClip)
    comes first in the order and keeps it (issue 47: fewer, larger kernels).
    """

    def add_noise(self) -> None:
        from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

        params = self.params  # type: ignore[attr-defined]
        if not params:
            return
        std = self.noise_multiplier * self.max_grad_norm  # type: ignore[attr-defined]
        sums = [p.summed_grad for p in params]
        for s in sums:
            _check_processed_flag(s)
        noise = flat_noise(std, sums, self.generator, self.secure_mode)  # type: ignore[attr-defined]
        for p, g in zip(params, torch._foreach_add(sums, noise), strict=True):
            p.grad = g.view_as(p)
        for s in sums:
            _mark_as_processed(s)

    def scale_grad(self) -> None:
        if self.loss_reduction == "mean" and self.params:  # type: ignore[attr-defined]
            scale = self.expected_batch_size * self.accumulated_iterations  # type: ignore[attr-defined]
            torch._foreach_div_([p.grad for p in self.params], scale)  # type: ignore[attr-defined]


def flat_noise(std: float, like: list[torch.Tensor], generator, secure_mode: bool):
    """N(0, std^2) shaped like each of `like`: one draw per dtype and device, cut into views.

    One kernel for the model instead of one per parameter tensor; the draw itself is
    `privacy.randomness.gaussian_noise`'s (the OS's for a secret generator, else the seeded one,
    Opacus' own for its secure mode and for std 0)."""
    out: list[torch.Tensor | None] = [None] * len(like)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(like):
        groups.setdefault((t.dtype, t.device), []).append(i)
    for (dtype, device), idx in groups.items():
        sizes = [like[i].numel() for i in idx]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        drawn = gaussian_noise(std, flat, generator=generator, secure_mode=secure_mode)
        for i, part in zip(idx, drawn.split(sizes), strict=True):
            out[i] = part.view_as(like[i])
    return out


def _marker(p: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((n, 0), dtype=p.dtype, device=p.device)


@functools.cache
def _with_clip(clip: type, base: type[DPOptimizer], multi: bool = False) -> type[DPOptimizer]:
    name = {BookKeepingClip: "BookKeeping", FP32Clip: "FP32Clip"}[clip] + base.__name__
    # FusedRelease derives from DPOptimizer, so it comes after `base` and before DPOptimizer
    tail = (FusedRelease,) if base is DPOptimizer else (base, FusedRelease)
    bases = (DistributedNoise, clip, *tail) if multi else (clip, *tail)
    return type(("Distributed" if multi else "") + name, bases, {"__module__": __name__})


def optimizer_class(
    base: type[DPOptimizer], wrapped: nn.Module, multi: bool | None = None
) -> type[DPOptimizer]:
    """The class to construct for algorithm class `base` and the module `wrapped_for_dp` made:
    `base` behind `BookKeepingClip` for a `BookKeepingModule`, else behind `FP32Clip`; behind
    `DistributedNoise` too when the job has several processes (`multi`; None: this job's)."""
    if issubclass(base, (BookKeepingClip, FP32Clip, DistributedNoise)):
        raise TypeError(f"{base.__name__} already has its clip; pass the algorithm's class")
    clip = BookKeepingClip if isinstance(wrapped, BookKeepingModule) else FP32Clip
    if multi is None:
        multi = distributed.world().multi
    return _with_clip(clip, base, multi)


def dp_optimizer(
    base: type[DPOptimizer],
    wrapped: nn.Module,
    *args: Any,
    precision: Precision | None = None,
    **kwargs: Any,
) -> DPOptimizer:
    """`optimizer_class(base, wrapped)(*args, **kwargs)`: the DP optimizer of an algorithm,
    clipping the way `wrapped` records gradients.

    `precision` (mixed precision, `precision.Precision`) learns where the per-example gradients
    are, to check them for fp16 overflow and cast them up before the clip.
    """
    cls = optimizer_class(base, wrapped)
    if issubclass(cls, BookKeepingClip):
        opt = cls(*args, bookkeeping=wrapped, **kwargs)  # bk's own clip runs under full_fp32
    else:
        opt = cls(*args, precision=precision, module=wrapped, **kwargs)
    if precision is not None:
        precision.bind(lambda: opt.params, wrapped)
    return opt
