"""Tied weights (one trained Parameter held by two modules, or twice by one) under book-keeping.

An example's gradient of a shared parameter is the sum of its uses' gradients, and its norm is
`|g_1 + g_2|`, anywhere between `||g_1| - |g_2||` and `|g_1| + |g_2|`. Book-keeping records and
clips module by module: each use's per-example gradient comes from its own record, its norm from
its own rule (a ghost norm, `|g| |a|`, a kept gradient), and nothing there holds the cross term
`2 g_1 . g_2`. Left alone, bk kept one use's clipped sum and dropped the other's (42 % off the
float64 reference on two tied Linear layers, 34 % on a tied embedding and head) while adding
both uses' squared norms; adding the two sums as well, without the cross term, would release up
to sqrt(2) times the clip bound for one example (both uses' gradients aligned), a hole in the
sensitivity the accountant assumes.

Exact support would need every rule (ghost norms, the flat-input product, the fused GroupNorm
kernel, torch.func's modules, the compiled phases) to materialise the shared parameter's
per-example gradients and sum them across records before any norm. Instead such a model is
refused when it is wrapped (and at each forward, since a strategy may unfreeze a tied parameter
later), with or without the self-test, naming the parameter, its holders and the modes that
clip it right: Opacus' hooks, functorch and ew add each use's per-example gradient into one
`grad_sample` before any norm (tests/per_sample/test_tied_parameters.py checks them against a
float64 torch.func reference). A frozen shared parameter is not clipped and is not refused.
"""

from __future__ import annotations

from torch import nn

# grad_sample_mode values whose per-example gradient of a shared parameter is its uses' sum
SUPPORTING_MODES = ("hooks", "functorch", "ew")


def shared_trained(model: nn.Module) -> dict[str, list[str]]:
    """Each trained parameter held more than once: its first name -> every holder, as
    "module path.attribute (Class)"."""
    holders: dict[int, list[str]] = {}
    for path, m in model.named_modules():
        for attr, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if p.requires_grad:
                name = f"{path}.{attr}" if path else attr
                holders.setdefault(id(p), []).append(f"{name} ({type(m).__name__})")
    return {uses[0].split(" ")[0]: uses for uses in holders.values() if len(uses) > 1}


def refuse_shared(model: nn.Module) -> None:
    shared = shared_trained(model)
    if shared:
        tied = "; ".join(f"{p!r} held as " + ", ".join(uses) for p, uses in shared.items())
        raise ValueError(
            f"grad_sample_mode 'bk' cannot clip a trained parameter shared by several uses "
            f"(tied weights): {tied}. Its per-example gradient is the sum over the uses, whose "
            "norm book-keeping does not compute; use grad_sample_mode "
            + " or ".join(SUPPORTING_MODES)
            + " (they sum the uses' per-example gradients before the norm), or freeze it"
        )
