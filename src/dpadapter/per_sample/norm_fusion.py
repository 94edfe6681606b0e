"""A GroupNorm's input gradient and per-example gradients from one backward kernel (issue 47).

Why: under book-keeping a GroupNorm whose input needs a gradient ran two backward kernels per
step: autograd's, for the input gradient (its weights switched off), and the per-example one
(`rules.group_norm_folded`: the batch folded into the channels, so that GroupNorm's own
weight-gradient kernel sums over one example only). Given the weight repeated once per example,
the folded kernel gives the input gradient as well: each folded group is one example's group,
with its own mean and 1/std, so it is the same formula over the same values. On this CPU it is
the same bits (float32, 1 and 2 threads, eight layer shapes in a /tmp script, 2026-11-28; every
model family's input gradients, norms and clipped sums in `test_norm_fusion.py`). One kernel
instead of two: twelve fewer a step on GNResNet-10, twenty-one on ResNet20-GN.

How: the layer's forward runs as always; book-keeping's forward hook then hands on, instead of
its output, the same values from `_FusedBackward`, whose backward runs the folded kernel, leaves
the output gradient and the per-example gradients in the layer's record, and returns the input
gradient. Autograd's own GroupNorm node is no longer on the graph and never runs. The weights
repeated per example for every fused layer come from one gather a forward (`RepeatedWeights`),
not one copy per layer, which would cost the kernel saved.

Where not: a layer whose input needs no gradient (its weights stay on and autograd's kernel
computes what is needed), a forward under autocast (the kernel's input is a cast copy) or in
bf16/fp16 (the norms phase takes low-precision records' per-example gradients in fp32), an
input that is not contiguous (folding it would copy it), a compiled forward (`compiled`: its
graphs fuse the kernels themselves, and a backward with side effects would not trace).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from dpadapter.per_sample import rules


class RepeatedWeights:
    """Every fusable GroupNorm's weight repeated once per example, (n C,) each, from one gather.

    A block per layer, laid out for the largest batch seen, so that a smaller batch's (n C,)
    is the start of its layer's block (a view): Poisson batches change size every step, and an
    index rebuilt per size would cost more kernels than it saves."""

    @classmethod
    def of_model(cls, model: nn.Module) -> RepeatedWeights:
        """For the model's GroupNorms that book-keeping clips by their closed form."""
        return cls(
            [m for m in model.modules() if isinstance(m, nn.GroupNorm) and rules.closed_form(m)]
        )

    def __init__(self, modules: list[nn.GroupNorm]):
        self.modules = [m for m in modules if m.weight is not None]
        self._index: torch.Tensor | None = None
        self._rows = 0
        self._starts: dict[nn.Module, int] = {}
        self._values: torch.Tensor | None = None  # this forward's gather, made at first use
        self._gathered: dict[nn.Module, tuple[int, int]] = {}  # module -> its weight's stamp

    def clear(self) -> None:
        """A new forward: the weights may have changed since the last."""
        self._values = None

    def of(self, module: nn.GroupNorm, n: int) -> torch.Tensor:
        c = module.num_channels
        # the asking layer's weight as gathered (identity, in-place version): values gathered
        # before an optimizer step (or a DP-SAT perturbation) are never handed out after it,
        # even where a forward skipped `clear`; one check per layer, not one per layer pair
        if self._values is None or n > self._rows or self._gathered[module] != _stamp(module):
            self._gathered = {m: _stamp(m) for m in self.modules}
            weights = [m.weight.detach().reshape(-1) for m in self.modules]
            index = self._index
            if index is None or n > self._rows or index.device != weights[0].device:
                self._build(weights, max(n, self._rows))  # grown, or the model moved
            assert self._index is not None
            self._values = torch.cat(weights).index_select(0, self._index)
        start = self._starts[module]
        return self._values[start : start + n * c]

    def _build(self, weights: list[torch.Tensor], rows: int) -> None:
        index, offset, start = [], 0, 0
        device = weights[0].device
        for m, w in zip(self.modules, weights, strict=True):
            c = w.numel()
            self._starts[m] = start
            index.append(torch.arange(c, device=device).repeat(rows) + offset)
            offset += c
            start += rows * c
        self._index = torch.cat(index)
        self._rows = rows


def _stamp(m: nn.Module) -> tuple[int, int]:
    return id(m.weight), m.weight._version


def fusable(module: nn.Module, x: torch.Tensor, output: torch.Tensor, saved: tuple) -> bool:
    """Whether `module`'s call can run its backward fused (see the module docstring)."""
    return (
        isinstance(module, nn.GroupNorm)
        and module.weight is not None
        and x.requires_grad
        and x.is_contiguous()
        and x.dim() >= 2
        and len(saved) == 2
        and x.dtype == output.dtype == module.weight.dtype == saved[0].dtype
        and x.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(x.device.type)
    )


def fused_output(
    rec: Any, x: torch.Tensor, output: torch.Tensor, weights: RepeatedWeights
) -> torch.Tensor:
    """`output`'s values, whose backward fills `rec.g` and `rec.per_example` (a `LayerRecord`
    with the forward's (mean, 1/std) in `rec.saved`) and returns `x`'s gradient."""
    repeated = weights.of(rec.module, x.shape[0])
    return _FusedBackward.apply(x, _Values(output.detach()), rec, repeated)


class _Values:
    """The layer's output values, handed to the Function beside its inputs, not as one: an
    output that is an input (or a view of one) may not be changed in place afterwards, and an
    in-place ReLU on a GroupNorm's output is common."""

    def __init__(self, t: torch.Tensor):
        self.t = t


class _FusedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, rec, weights):  # type: ignore[override]
        ctx.rec, ctx.weights = rec, weights
        ctx.save_for_backward(x)
        return values.t

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        rec = ctx.rec
        dx, gw, gb = rules.group_norm_folded(rec.module, x, grad, rec.saved, ctx.weights)
        rec.g = grad.detach()
        rec.per_example = (gw, gb)
        return dx, None, None, None
