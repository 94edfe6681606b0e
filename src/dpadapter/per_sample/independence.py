"""Before any private step: no module mixes the examples of a batch or learns from them.

DP-SGD's sensitivity is C only if each example's clipped gradient depends on that example
alone, and the released model holds nothing computed from private data but the noisy sums.
Both fail, silently, for any layer that normalises with batch statistics (BatchNorm, timm's
EvoNorm B*) or updates buffers in its forward (running statistics, `InstanceNorm2d(
track_running_stats=True)`), whatever its type and whether or not its parameters are trained:
a layer without trainable parameters is invisible to Opacus' validator and to the per-sample
modes, yet it shapes every other layer's gradient. So the check is by behaviour, not by class:

1. A synthetic batch (`EXAMPLES` rows from a private generator, the data's sample shape; no
   private value is read) runs through the model in the mode it will train in (`model.train()`),
   every module's first call recorded.
2. Each module, deepest first, is called again on its recorded inputs, and once more with one
   example's rows replaced (`PERTURBED`), under the same random seed (dropout draws the same
   masks): the other examples' outputs must not move, and none of its own buffers may change.
   Inputs whose first dimension is not the batch are not perturbed (the enclosing module's
   call covers them; the model itself is the last checked).
3. A module that fails and holds buffers (running statistics) is pinned to eval mode
   (`models.pinned`: its statistics are read and never updated, whatever `train()` says) and
   checked again; if it passes, its statistics are frozen and reported. Any other failure
   refuses training, naming each module (qualified name and type).

Every buffer is restored after each call, the modules' modes after the check, and the global
RNG is forked: the check leaves the model as it found it, but for the pins. DP training paths
reach it through `per_sample.wrap_for_dp` (at wrap time, or at the wrapped module's first
forward when no sample shape was given), so no path trains a model that mixes examples.
BatchNorm itself is frozen earlier by `models.batchnorm.freeze_batchnorm` (which keeps its
trainable scale and shift apart from its statistics, as Opacus needs); this check catches what
that leaves.

Outputs are compared to `TOLERANCE` of their largest magnitude: kernels are deterministic
for a fixed shape on the CPU, and mixing through batch statistics moves outputs by O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dpadapter.device import full_fp32
from dpadapter.models.batchnorm import FrozenBatchNorm
from dpadapter.models.pinned import is_pinned, pin_eval, unpin, unpinned_type

EXAMPLES = 6  # rarely a sequence length or a channel count: dim 0 of a batch-first input
PERTURBED = 2  # the example changed; every other one must not move
SEED = 0x1DE9E4D5  # the synthetic inputs' own generator: nothing else draws from it
TOLERANCE = 1e-6


class MixedExamplesError(ValueError):
    """A module mixes the examples of a batch, or learns from them: DP training is refused."""


@dataclass(frozen=True)
class Independence:
    """What the check found: modules whose statistics are frozen, and which it pinned."""

    frozen: tuple[str, ...]  # "'name' (Type)": every FrozenBatchNorm and pinned module
    pinned: tuple[str, ...]  # those this check pinned (not by freeze_batchnorm)
    examples: int
    mode: str  # "train": the mode DP training runs in; "eval": feature extraction


def make_independent(
    model: nn.Module,
    sample_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    train: bool = True,
    examples: int = EXAMPLES,
) -> Independence:
    """Check `model` in training (or eval) mode; pin what can be pinned, else refuse.

    Returns the record for the log and metrics.json; raises MixedExamplesError naming every
    module that still mixes examples or updates buffers.
    """
    if examples < 2 or not 0 <= PERTURBED < examples:
        raise ValueError(f"the independence check needs at least {PERTURBED + 1} examples")
    device = _device(model)
    modes = {m: m.training for m in model.modules()}
    pinned: list[tuple[str, nn.Module]] = []
    refused: list[str] = []
    try:
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), full_fp32():
            model.train(train)
            x = _synthetic((examples, *sample_shape), dtype, device)
            calls = _record_calls(model, x)
            bad: set[nn.Module] = set()  # refused, or containing a refused module
            for name, m in reversed(list(model.named_modules())):  # children first
                if any(c in bad for c in m.children()):
                    bad.add(m)  # named through its child
                    continue
                if m not in calls:  # never called: nothing to check
                    continue
                why = _fault(m, calls[m], examples)
                if why is None:
                    continue
                if train and _own_buffers(m) and not is_pinned(m):
                    pin_eval(m)
                    if _fault(m, calls[m], examples) is None:
                        pinned.append((name, m))
                        continue
                    unpin(m)
                bad.add(m)
                refused.append(f"{_label(name, m)}: {why}")
    finally:
        for m, training in modes.items():
            m.training = training  # a pinned module ignores it
    if refused:
        for _, m in pinned:
            unpin(m)
        raise MixedExamplesError(
            "refused before any private step: in "
            + ("training" if train else "eval")
            + " mode, "
            + "; ".join(refused)
            + ". Such a module has no per-example gradient (each example's clipped gradient "
            "would depend on the rest of its batch, so the sensitivity is not C) or learns "
            "from private data outside the accounting. Replace it (GroupNorm, LayerNorm), or "
            "give it running statistics from public data so that it can be frozen."
        )
    return Independence(
        frozen=tuple(frozen_statistics(model)),
        pinned=tuple(_label(n, m) for n, m in pinned),
        examples=examples,
        mode="train" if train else "eval",
    )


def frozen_statistics(model: nn.Module) -> list[str]:
    """The label ('name' (Type)) of every module of `model` whose statistics are frozen."""
    inner = {id(m.norm) for m in model.modules() if isinstance(m, FrozenBatchNorm)}
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FrozenBatchNorm):
            out.append(_label(name, m.norm))
        elif is_pinned(m) and id(m) not in inner:
            out.append(_label(name, m))
    return out


def _label(name: str, m: nn.Module) -> str:
    return f"{name or '<root>'!r} ({unpinned_type(m).__name__})"


def _device(model: nn.Module) -> torch.device:
    t = next((t for t in [*model.parameters(), *model.buffers()]), None)
    return t.device if t is not None else torch.device("cpu")


def _synthetic(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(device, dtype)
    return torch.randint(0, 2, shape, generator=gen).to(device, dtype)


def _own_buffers(m: nn.Module) -> bool:
    return any(b is not None for b in m._buffers.values())


def _record_calls(model: nn.Module, x: torch.Tensor) -> dict[nn.Module, tuple]:
    """Each module's first (args, kwargs) in one forward of `model` on x; buffers restored."""
    calls: dict[nn.Module, tuple] = {}

    def keep(module, args, kwargs):
        calls.setdefault(module, (tree_map(_detached, args), tree_map(_detached, kwargs)))

    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in model.modules()]
    snap = snapshot_buffers(model)
    try:
        torch.manual_seed(SEED)
        model(x)
    finally:
        for h in handles:
            h.remove()
        restore_buffers(snap)
    return calls


def _fault(m: nn.Module, call: tuple, n: int) -> str | None:
    """Why `m` is not per-example in its current mode (None: it is)."""
    args, kwargs = call
    out, changed = _run(m, args, kwargs)
    if m in changed:
        names = ", ".join(sorted(changed[m]))
        return f"its forward changes its buffers ({names})"
    perturbed, any_row = _perturb((args, kwargs), n)
    if not any_row:
        return None
    out2, _ = _run(m, *perturbed)
    for a, b in zip(tree_leaves(out), tree_leaves(out2), strict=False):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
            continue
        if a.dim() == 0 or a.shape[0] != n or not a.is_floating_point():
            continue
        keep = torch.arange(n, device=a.device) != PERTURBED
        ref, got = a[keep].double(), b[keep].double()
        scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
        if not bool(((got - ref).abs() <= TOLERANCE * scale).all()):
            return (
                f"its output for one example changes when another example of the batch "
                f"changes (example {PERTURBED + 1} of {n})"
            )
    return None


def _run(m: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, dict[nn.Module, list[str]]]:
    args, kwargs = tree_map(_cloned, (args, kwargs))  # an in-place forward keeps the record
    snap = snapshot_buffers(m)
    try:
        torch.manual_seed(SEED)  # the same draws for both calls (dropout's masks)
        out = tree_map(_cloned, m(*args, **kwargs))
    finally:
        changed = restore_buffers(snap)
    return out, changed


def _perturb(tree: Any, n: int) -> tuple[Any, bool]:
    """`tree` with example PERTURBED changed in every batch-first tensor (other rows kept)."""
    gen = torch.Generator().manual_seed(SEED + 1)
    changed = False

    def one(v: Any) -> Any:
        nonlocal changed
        if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] != n:
            return v
        v = v.clone()
        if v.is_floating_point():
            fresh = torch.randn(v.shape[1:], generator=gen).to(v.device, v.dtype)
            v[PERTURBED] = fresh * 3 + 1
        else:  # ids, masks: another example's values are valid ones
            v[PERTURBED] = v[(PERTURBED + 1) % n]
        changed = True
        return v

    return tree_map(one, tree), changed


def _detached(v: Any) -> Any:
    return v.detach() if torch.is_tensor(v) else v


def _cloned(v: Any) -> Any:
    return v.clone() if torch.is_tensor(v) else v


def snapshot_buffers(m: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    """Every buffer of `m` and its submodules, with a copy of its values (`restore_buffers`)."""
    return [
        (mod, k, t, t.detach().clone())
        for mod in m.modules()
        for k, t in mod._buffers.items()
        if t is not None
    ]


def restore_buffers(snap) -> dict[nn.Module, list[str]]:
    """Put every buffer back (object and values); return those that had changed, by module."""
    changed: dict[nn.Module, list[str]] = {}
    for mod, k, t, saved in snap:
        now = mod._buffers.get(k)
        if now is not t or not _same(t, saved):
            changed.setdefault(mod, []).append(k)
            mod._buffers[k] = t
            t.copy_(saved)
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)
