"""Mixed precision of the DP step (`finetune.precision`: fp32, bf16, fp16).

Only the training loss's forward and backward run under `torch.autocast`: that is where the
time goes. Everything the privacy guarantee rests on stays in the parameters' precision (fp32
master weights): per-example gradients that come out of autocast in bf16/fp16 (Opacus' hooks
and ew modes, bk's recorded activations and output gradients) are cast up before their norms
are taken, so the norms, the clip factors and the clipped sum are computed from one and the same
fp32 vector per example and `c_i |g_i| <= C` holds to fp32 rounding. Opacus draws the noise in
the dtype of the clipped sum, so it is fp32 too: Gaussian noise rounded to a 8- or 11-bit
mantissa is no longer Gaussian, and the accountant's analysis would not apply to it. (Opacus
1.6 alone would take the norms in bf16 and the sum from the fp32 cast, whose norm can exceed
the clipped bound by bf16's rounding.) The backward runs inside the autocast region as well:
Opacus' ew and hooks modes compute per-example gradients in backward hooks from the recorded
activations, and outside autocast those mix bf16 and fp32 operands.

fp16's narrow range needs a loss scale S: the loss is multiplied by S before the backward and
the per-example gradients divided by S (in fp32) before their norms, so the clip bound is on
the true gradient. An overflow (a non-finite per-example gradient) is not skipped the way
`torch.amp.GradScaler` skips an update: the step's release has not been made yet (no noise is
drawn before clipping), and computing the same physical batch's per-example gradients again
releases nothing. So the scale is halved and the same examples are recomputed, the RNG state
restored so that dropout draws the same masks, up to `max_recomputations` times per batch; a
batch that still overflows is computed once more in fp32 (its scale 1, no autocast), and the
next batch starts from the scale this one started from. A run never stops on an overflow: that
would publish a data-dependent event (its failure) outside the accounting. Nothing is dropped
from the Poisson schedule: the ledger records every sampled step, as in fp32. (Accounting a
skipped step as a release, the other honest option, would spend privacy for no update and leave
the schedule's sigma calibrated for steps that do not train.) The scale starts at
GradScaler's 2^16; Opacus' hooks and ew modes compute per-example gradients in fp16, n times a
mean gradient's size, so a run's first batch usually halves it a few times. It grows back (x2)
after `growth_interval` clean physical batches, as GradScaler's does; the growth comes after
that batch's backward, so its per-example gradients are divided by the scale the backward ran at
(`Precision.scale`), not by the grown one (which halved them on every growth batch in Opacus'
modes; bk's `grad_scale` is set before the backward). The scale's course
(which batches overflowed, how often it was recomputed, where it stands) is a function of the
private data: it lives in the resume state, which is as secret as the data, and is never
published. `describe`, which goes to metrics.json and MLflow, gives the configuration only.
bf16 has fp32's range and needs no scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpadapter.ground.device import rng_state, set_rng_state
from dpadapter.per_sample.bookkeeping import BookKeepingModule

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOW_PRECISION = (torch.bfloat16, torch.float16)


class GradientOverflow(RuntimeError):
    """A non-finite scaled per-example gradient reached the clip (unreachable: the check after
    each backward recomputes such a batch)."""


@dataclass
class LossScale:
    """fp16's dynamic loss scale; powers of two, so scaling and unscaling are exact."""

    scale: float = 2.0**16
    backoff: float = 0.5
    growth: float = 2.0
    growth_interval: int = 200
    max_scale: float = 2.0**24
    max_recomputations: int = 24  # per physical batch: 2^16 down to 2^-8
    recomputations: int = 0
    overflowed_batches: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)  # (physical batch, new S)
    _clean: int = 0
    _batches: int = 0

    def overflowed(self) -> None:
        self.scale *= self.backoff
        self.recomputations += 1
        self.history.append((self._batches, self.scale))

    def clean(self) -> None:
        self._batches += 1
        self._clean += 1
        if self._clean >= self.growth_interval and self.scale < self.max_scale:
            self.scale = min(self.scale * self.growth, self.max_scale)
            self._clean = 0
            self.history.append((self._batches, self.scale))

    def describe(self) -> dict[str, Any]:
        """The settings, fixed before any data is read; never the course of the scale."""
        return {
            "loss_scale_initial": LossScale.scale,
            "loss_scale_growth_interval": self.growth_interval,
            "loss_scale_max_recomputations": self.max_recomputations,
            "loss_scale_exhausted": "batch recomputed in fp32",
        }


class Precision:
    """How the DP step computes its gradient; fp32 (the default) is the plain forward/backward.

    `bind` (from `optimizers.dp_optimizer`) gives it the optimizer's parameters and the
    wrapped module, whose per-example gradients it checks for overflow and unscales.
    """

    def __init__(self, name: str = "fp32", device_type: str = "cpu"):
        if name not in PRECISIONS:
            raise ValueError(f"finetune.precision {name!r}: use one of {PRECISIONS}")
        self.name = name
        self.device_type = device_type
        self.dtype = _DTYPES.get(name)
        self.scaler = LossScale() if name == "fp16" else None
        self._params: Callable[[], list[nn.Parameter]] = list
        self._wrapped: nn.Module | None = None
        self._in_fp32 = False  # the current batch overflowed at every scale: fp32, scale 1
        # the scale the last backward ran at: `clean` may grow the scaler's before the clip runs
        self._used: float | None = None

    def bind(self, params: Callable[[], list[nn.Parameter]], wrapped: nn.Module) -> None:
        self._params = params
        self._wrapped = wrapped

    @property
    def scale(self) -> float:
        """What the current batch's per-example gradients are scaled by: the scale its backward
        ran at, not the scaler's, which `LossScale.clean` has grown on a growth batch (dividing
        by that halved every example's gradient on such a batch)."""
        if self.scaler is None:
            return 1.0
        return self.scaler.scale if self._used is None else self._used

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
        """Forward and backward of the training loss on one physical batch; returns the loss.

        Under fp16 the per-example gradients are left scaled by `scale`; the clip divides.
        """
        if self.dtype is None:
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss
        if self.scaler is None:
            with self.autocast():
                loss = loss_fn(model(x), y)
                loss.backward()
            return loss.float()
        return self._scaled_gradient(model, x, y, loss_fn)

    def _scaled_gradient(self, model: nn.Module, x, y, loss_fn) -> torch.Tensor:
        scaler = self.scaler
        assert scaler is not None
        device = x.device
        rng = rng_state(device)
        start = scaler.scale
        self._in_fp32 = False
        for attempt in range(scaler.max_recomputations + 1):
            if attempt:
                scaler.overflowed()
                self._clear()
                set_rng_state(rng)
            self._set_grad_scale(scaler.scale)
            self._used = scaler.scale
            with self.autocast():
                loss = loss_fn(model(x), y)
                (loss * scaler.scale).backward()
            if self._finite():
                if attempt:
                    scaler.overflowed_batches += 1
                scaler.clean()
                return loss.float()
        # No scale helps (the forward itself overflows fp16): this batch in fp32, as an fp32
        # run computes it, rather than a stop; the next batch starts where this one did.
        self._clear()
        set_rng_state(rng)
        scaler.scale = start
        scaler.overflowed_batches += 1
        self._in_fp32 = True
        self._set_grad_scale(1.0)
        self._used = 1.0
        loss = loss_fn(model(x), y)
        loss.backward()
        scaler.clean()
        return loss

    def _set_grad_scale(self, scale: float) -> None:
        if isinstance(self._wrapped, BookKeepingModule):
            self._wrapped.grad_scale = scale

    def _clear(self) -> None:
        """Drop the overflowed attempt's per-example and plain gradients (not the sums so far)."""
        for p in self._params():
            p.grad_sample = None
            p.grad = None
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample

    def _finite(self) -> bool:
        if isinstance(self._wrapped, BookKeepingModule):
            return self._wrapped.recorded_finite()
        return all_finite(_grad_samples(self._params()))

    def unscale(self, params: list[nn.Parameter]) -> None:
        """Opacus' per-example gradients in their parameter's dtype and divided by the scale,
        before the clip takes their norms (called by the clip; no-op in fp32)."""
        if self.dtype is None:
            return
        s = self.scale
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                continue
            if isinstance(gs, list):
                p.grad_sample = [_up(g, p.dtype, s) for g in gs]
            else:
                p.grad_sample = _up(gs, p.dtype, s)
        if self.scaler is not None and not self._in_fp32 and not all_finite(_grad_samples(params)):
            # the check after the backward makes this unreachable; a scaled vector is never
            # clipped unless it is finite
            raise GradientOverflow("a non-finite per-example gradient reached the clip")

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        sc = self.scaler
        return {
            "loss_scale": {
                "scale": sc.scale,
                "recomputations": sc.recomputations,
                "overflowed_batches": sc.overflowed_batches,
                "history": [list(h) for h in sc.history],
                "clean": sc._clean,
                "batches": sc._batches,
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("loss_scale")
        if self.scaler is None or saved is None:
            return
        sc = self.scaler
        sc.scale, sc.recomputations = saved["scale"], saved["recomputations"]
        sc.overflowed_batches = saved["overflowed_batches"]
        sc.history = [tuple(h) for h in saved["history"]]
        sc._clean, sc._batches = saved["clean"], saved["batches"]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": self.name}
        if self.scaler is not None:
            out.update(self.scaler.describe())
        return out


def all_finite(tensors) -> bool:
    """One device sync for all of them, not one per tensor."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack(flags).all()) if flags else True


def _up(g: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """In `dtype` and divided by `scale`, once: a tensor already done is marked (a second clip
    of the same per-example gradients must not divide them again)."""
    if getattr(g, "_dp_unscaled", False):
        return g
    g = g.to(dtype)
    g = g if scale == 1.0 else g / scale
    g._dp_unscaled = True  # type: ignore[attr-defined]
    return g


def _grad_samples(params: list[nn.Parameter]) -> Iterator[torch.Tensor]:
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if isinstance(gs, list):
            yield from gs
        elif gs is not None:
            yield gs


def make_precision(name: str, device: torch.device) -> Precision:
    """The run's precision on `device`; bf16 on a GPU without it fails here, before training."""
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"finetune.precision bf16: {torch.cuda.get_device_name(device)} has no bf16; "
            "use fp16 or fp32"
        )
    return Precision(name, device.type)
