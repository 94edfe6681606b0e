"""Per-example gradients of one module's own parameters by torch.func, from a recorded call.

Book-keeping (`bookkeeping`) has closed forms for Linear, Conv2d, GroupNorm and LayerNorm only.
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

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten


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
