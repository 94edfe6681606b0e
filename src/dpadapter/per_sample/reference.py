"""The per-sample self-test's reference: torch.func's per-example gradients, reduced as they
stream by, in float64 (the truth) and in the parameters' own dtype (its rounding).

A module's per-example gradient can be the small difference of large terms (a conv bias in
front of a GroupNorm: the norm makes the loss almost blind to a shift, so the bias gradient
nearly cancels over the positions). In float32 two right implementations then differ by far more
than float32's epsilon relative to that module's own norm (1.2e-3 measured for BiTFiT's first
conv bias). Judging each module against its own norm needs the rounding each module's quantity
suffers, so it is measured, not assumed: the reference runs in float64 and in the working
dtype, and `norm_noise` / `sum_noise` say how far apart they came out, module by module. The
self-test allows a small multiple of that (`self_test.ROUNDING_MARGIN`) on top of its relative
tolerance. A model that cannot run in float64 falls back to the working dtype alone, with a
rounding allowance of `FALLBACK_NOISE` of each module's norm.

Gradients are of each example's own loss (cross-entropy of the example alone), over the
model's trainable parameters, under `vmap` in chunks of at most `CHUNK_ELEMENTS` gradient
elements (one example at a time where an op has no batching rule): nothing of size n x p is
kept. The clip bound C is the median norm of the first chunk (about half the examples clipped,
so both branches of the clip run), and the clipped sums use Opacus' clip factor
(`clip.clip_factors`) on the float64 norms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dpadapter.per_sample.clip import clip_factors

CHUNK_ELEMENTS = 1 << 24  # per-example gradient elements held at once, per dtype
FALLBACK_NOISE = 1e-3  # relative rounding assumed when no float64 reference can be had


@dataclass(frozen=True)
class Reference:
    """Per module ("module 'name' (Class)"): what the mode's clipping must reproduce."""

    norms: dict[str, torch.Tensor]  # (n,) float64 per-example norms
    sums: dict[str, list[torch.Tensor]]  # sum_i c_i g_i per parameter, float64
    shares: dict[str, float]  # sum_i c_i |g_i| of the module: the scale of its sum
    clip: float  # C
    norm_noise: dict[str, float]  # max_i |norm (own dtype) - norm (float64)| / scale_i
    whole_noise: float  # the same for the whole gradient
    sum_noise: dict[str, float]  # |sum (own dtype) - sum (float64)|
    dtype: str  # of the truth: "float64", or the working dtype where float64 failed
    # (n,) the same norms from the working dtype's gradients (the reference's own rounding,
    # example by example: `margins.worst_examples`)
    norms_working: dict[str, torch.Tensor] = field(default_factory=dict)


def reference(
    model: nn.Module,
    groups: dict[str, list[nn.Parameter]],
    x: torch.Tensor,
    y: torch.Tensor,
    floor: float,
) -> Reference:
    """The reference for `groups` (module -> trained parameters) on the batch (x, y).

    `floor` (a fraction of the example's whole norm) bounds the scale a module's noise is
    measured against from below, as the self-test's errors are.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    keys = {mod: [names[id(p)] for p in ps] for mod, ps in groups.items()}
    params = {k: p.detach() for ps in groups.values() for p in ps for k in [names[id(p)]]}
    size = sum(p.numel() for p in params.values())
    n = len(y)
    chunk = max(1, min(n, CHUNK_ELEMENTS // max(size, 1)))
    working = _gradients(model, params, None)
    exact: Callable | None = _gradients(model, params, torch.float64)
    norms: dict[str, list[torch.Tensor]] = {mod: [] for mod in groups}
    norms_w: dict[str, list[torch.Tensor]] = {mod: [] for mod in groups}
    shares = dict.fromkeys(groups, 0.0)
    noise = dict.fromkeys(groups, 0.0)
    whole_noise = 0.0
    sums = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    sums_w = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    clip = None
    for i in range(0, n, chunk):
        j = min(n, i + chunk)
        g_w = working(x[i:j], y[i:j])
        g = g_w
        if exact is not None:
            try:
                g = exact(x[i:j], y[i:j])
            except (RuntimeError, TypeError):  # a model that casts to float32 itself
                exact, g = None, g_w
        by_mod = {mod: _rows_norm([g[k] for k in ks]) for mod, ks in keys.items()}
        by_mod_w = {mod: _rows_norm([g_w[k] for k in ks]) for mod, ks in keys.items()}
        whole = torch.sqrt(sum(v.pow(2) for v in by_mod.values()))
        whole_w = torch.sqrt(sum(v.pow(2) for v in by_mod_w.values()))
        tiny = torch.finfo(torch.float64).tiny
        whole_noise = max(whole_noise, _max((whole_w - whole).abs() / whole.clamp(tiny)))
        if clip is None:  # about half of the examples clipped: both branches run
            clip = float(whole.median())
        c = clip_factors(whole, clip)
        for mod, v in by_mod.items():
            norms[mod].append(v)
            norms_w[mod].append(by_mod_w[mod])
            shares[mod] += float((c * v).sum())
            scale = torch.maximum(v, floor * whole).clamp(min=tiny)
            noise[mod] = max(noise[mod], _max((by_mod_w[mod] - v).abs() / scale))
        for k in params:
            cd = c.to(g[k].device)
            sums[k] += torch.tensordot(cd, g[k].double(), dims=1)
            sums_w[k] += torch.tensordot(cd, g_w[k].double(), dims=1)
    if exact is None:  # nothing to measure rounding against: assume it
        noise = dict.fromkeys(groups, FALLBACK_NOISE)
        whole_noise = FALLBACK_NOISE
        sum_noise = {mod: FALLBACK_NOISE * shares[mod] for mod in groups}
        sums = sums_w
    else:
        sum_noise = {
            mod: float(torch.sqrt(sum((sums_w[k] - sums[k]).pow(2).sum() for k in ks)))
            for mod, ks in keys.items()
        }
    return Reference(
        norms={mod: torch.cat(v) for mod, v in norms.items()},
        sums={mod: [sums[k] for k in ks] for mod, ks in keys.items()},
        shares=shares,
        clip=float(clip),
        norm_noise=noise,
        whole_noise=whole_noise,
        sum_noise=sum_noise,
        dtype="float64" if exact is not None else str(next(iter(params.values())).dtype)[6:],
        norms_working={mod: torch.cat(v) for mod, v in norms_w.items()},
    )


def _gradients(model: nn.Module, params: dict[str, torch.Tensor], dtype: torch.dtype | None):
    """(x, y) -> {name: (k, *shape)}: each example's gradient, in `dtype` (None: as is).

    In float64 the buffers go in as float64 too (`functional_call` takes both)."""
    q = {k: v.to(dtype) for k, v in params.items()} if dtype else params
    bufs = {}
    if dtype is not None:
        bufs = {k: b.to(dtype) if b.is_floating_point() else b for k, b in model.named_buffers()}

    def loss(q, xi, yi):
        return F.cross_entropy(functional_call(model, {**q, **bufs}, (xi[None],)), yi[None])

    batched = vmap(grad(loss), in_dims=(None, 0, 0))

    def run(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        try:
            return batched(q, x, y)
        except RuntimeError:  # an op without a batching rule: one example at a time
            per = [grad(loss)(q, x[i], y[i]) for i in range(len(y))]
        return {k: torch.stack([g[k] for g in per]) for k in q}

    return run


def _rows_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n,) float64 norms of the rows of several (n, ...) tensors together, on the CPU."""
    return torch.sqrt(sum(t.detach().double().flatten(1).pow(2).sum(1) for t in tensors)).cpu()


def _max(t: torch.Tensor) -> float:
    v = float(t.max()) if t.numel() else 0.0
    return float("inf") if v != v else v
