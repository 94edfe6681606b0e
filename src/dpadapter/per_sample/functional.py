"""Book-keeping's fallback: per-example gradients of one module's own parameters by torch.func.

Book-keeping (`bookkeeping`) has closed forms (`rules`) for Linear, Conv2d, GroupNorm and
LayerNorm only, and a ViT's own tokens (`tokens`).
Any other module that owns trainable parameters (a ViT's `cls_token` and `pos_embed` on its
root module, LayerScale's `gamma`, an eval-mode BatchNorm's affine, timm's LayerNorm2d) keeps
the arguments it was called with and the loss gradient at its output; its per-example
gradients are then `vjp` of its own forward, one example at a time under `vmap`, each example
with a leading batch dimension of 1 (the way Opacus' functorch mode treats a layer). The
modules it calls are constants there: their parameters are not differentiated, so each
parameter's gradient is taken exactly once, by the module that owns it.

Which inputs are per-example: every tensor argument whose first dimension is the batch size;
any other argument is shared by all examples. That is right for batch-first models (the
pipeline's convention); a module whose output is not batch-first is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpadapter.per_sample import arena
from dpadapter.per_sample.tokens import TokenLayout


@dataclass
class FuncRecord:
    """A module without a closed form: its call's arguments and output gradient (torch.func)."""

    module: nn.Module
    name: str
    args: tuple
    kwargs: dict[str, Any]
    params: dict[str, nn.Parameter]
    n: int = 0
    g: torch.Tensor | None = None
    strategy: str = "torch.func"
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: TokenLayout | None = None  # a ViT's own tokens: a closed form, no replay (tokens)


# What the recording module gives for a replay: a context in which its hooks record nothing
# (torch.func runs the module's forward again).
Replay = Callable[[], contextlib.AbstractContextManager]


def module_grads(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict[str, Any],
    g: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """{name: (n, *shape)}: each example's gradient of `<g_i, module(x_i)>` w.r.t. `params`."""
    n = g.shape[0]
    leaves, spec = tree_flatten((args, kwargs))
    batched = [isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n for v in leaves]
    tensors = [v for v, b in zip(leaves, batched, strict=True) if b]

    def one(p: dict[str, torch.Tensor], rows: list[torch.Tensor], g_i: torch.Tensor):
        it = iter(rows)
        full = [next(it).unsqueeze(0) if b else v for v, b in zip(leaves, batched, strict=True)]
        a, kw = tree_unflatten(full, spec)

        def f(q: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(module, q, a, kw)

        _, back = vjp(f, p)
        return back(g_i.unsqueeze(0))[0]

    return vmap(one, in_dims=(None, 0, 0), randomness="error")(params, tensors, g)


def func_grads(rec: FuncRecord, wanted: set[int], replay: Replay) -> dict[int, torch.Tensor]:
    """{id(p): (n, *p.shape)} for the wanted parameters of a module without a closed form."""
    assert rec.g is not None
    params = {k: p.detach() for k, p in rec.params.items() if id(p) in wanted}
    if not params:
        return {}
    if rec.tokens is not None:
        grads = rec.tokens.grads(rec.g, params)
        return {id(rec.params[k]): v for k, v in grads.items()}
    with replay():
        try:
            grads = module_grads(rec.module, params, rec.args, rec.kwargs, rec.g)
        except RuntimeError as e:
            if "random" not in str(e):
                raise
            raise RuntimeError(
                f"grad_sample_mode 'bk': {rec.name or '<root>'} ({type(rec.module).__name__}) "
                "draws random numbers in its forward (dropout?), which its per-example "
                f"gradients cannot replay: {e}"
            ) from e
    return {id(rec.params[k]): v for k, v in grads.items()}


def func_norms_sq(
    rec: FuncRecord, wanted: set[int], keep: int, replay: Replay
) -> list[torch.Tensor]:
    """Squared per-example norms (n,) as parts to add; gradients up to `keep` elements are kept
    for the sum (`rec.kept`) and left out of the parts, as the closed forms do (`arena.keep`)."""
    rec.kept = {}
    grads = func_grads(rec, wanted, replay)
    parts = [arena.keep(rec.kept, pid, g, keep) for pid, g in grads.items()]
    return [part for part in parts if part is not None]


def func_sums(
    rec: FuncRecord, weights: torch.Tensor, wanted: set[int], replay: Replay
) -> dict[int, torch.Tensor]:
    """Weighted sums of the wanted parameters' per-example gradients (kept or recomputed)."""
    todo = {id(p) for p in rec.params.values() if id(p) in wanted and id(p) not in rec.kept}
    fresh = func_grads(rec, todo, replay) if todo else {}
    out = {}
    for p in rec.params.values():
        grads = rec.kept.get(id(p), fresh.get(id(p)))
        if id(p) in wanted and grads is not None:
            out[id(p)] = torch.tensordot(weights.to(grads.dtype), grads, dims=1)
    return out
