"""Before any private step: no module mixes the examples of a batch or learns from them.

DP-SGD's sensitivity is C only if each example's clipped gradient depends on that example
alone, and the released model holds nothing computed from private data but the noisy sums.
Both fail, silently, for any layer that normalises with batch statistics (BatchNorm, timm's
EvoNorm B*), updates buffers in its forward (running statistics, `InstanceNorm2d(
track_running_stats=True)`), keeps a tensor computed from its inputs as a plain attribute, or
mixes the examples' gradients in a custom backward, whatever its type and whether or not its
parameters are trained: a layer without trainable parameters is invisible to Opacus' validator
and to the per-sample modes, yet it shapes every other layer's gradient. So the check is by
behaviour, not by class:

1. A synthetic batch (rows from a private generator, the data's sample shape; no private value
   is read) runs through the model in the mode it will train in (`model.train()`), every
   module's first call recorded. This is done at two batch sizes (`batch_sizes`: the given one
   and an odd one beside it), since a module may mix only at some sizes; at the second, the
   whole model is checked first, and module by module only to name what failed.
2. Each module, deepest first, is called again on its recorded inputs, and once more per
   changed example (`positions`: the first, since a module may mix through a reference
   example such as `z - z[:1]`, one inside and the last) with that example's rows replaced,
   under the same random seed (dropout draws the same masks). Every other example's output
   must not move; in training mode, with a random output gradient that is zero on the changed
   example (for the leaf modules and the whole model: a container's own backward shows at the
   root), neither may the gradients of the module's inputs (the other examples' rows) nor of
   its trainable parameters, and the changed example's own input gradient must be zero (a
   custom backward that mixes gradients fails here, whatever its forward does); none of its
   buffers may change, and the tensors it keeps in plain attributes may not differ between two
   calls on different inputs (`module_state`: a cache of what the shape determines passes).
   Inputs whose first dimension is not the batch are not changed (the enclosing module's call
   covers them; the model itself is the last checked).
3. A module that fails and holds buffers (running statistics) is pinned to eval mode
   (`models.pinned`: its statistics are read and never updated, whatever `train()` says) and
   checked again; if it passes, its statistics are frozen and reported. Any other failure
   refuses training, naming each module (qualified name and type).

Every buffer and tensor attribute is restored after each call, the modules' modes after the
check, and the global RNG is forked: the check leaves the model as it found it, but for the
pins. DP training paths reach it through `per_sample.wrap_for_dp` (at wrap time, or at the
wrapped module's first forward when no sample shape was given), so no path trains a model that
mixes examples. BatchNorm itself is frozen earlier by `models.batchnorm.freeze_batchnorm` (which
keeps its trainable scale and shift apart from its statistics, as Opacus needs); this check
catches what that leaves. A module can still evade any behavioural check (mixing only at a size
never tried, or on a later call); docs/privacy.md lists what the bound rests on.

Outputs and gradients are compared to `TOLERANCE` of their largest magnitude: kernels are
deterministic for a fixed shape (on the CPU; on CUDA inside `device.deterministic_kernels`, no
TF32), an example whose output gradient is zero adds exact zeros to every sum, and mixing moves
values by O(1). A refusal names the largest change it saw, in units of that magnitude.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dpadapter.ground.device import deterministic_kernels, full_fp32
from dpadapter.models.batchnorm import FrozenBatchNorm
from dpadapter.models.pinned import is_pinned, pin_eval, unpin, unpinned_type
from dpadapter.per_sample.module_state import (
    attribute_values,
    hooks_suspended,
    restore_attributes,
    restore_buffers,
    same_values,
    snapshot_attributes,
    snapshot_buffers,
)

EXAMPLES = 6  # rarely a sequence length or a channel count: dim 0 of a batch-first input
PERTURBED = 2  # the example changed inside the batch (besides the first and the last)
SEED = 0x1DE9E4D5  # the synthetic inputs' own generator: nothing else draws from it
TOLERANCE = 1e-6

__all__ = [
    "EXAMPLES",
    "Independence",
    "MixedExamplesError",
    "batch_sizes",
    "frozen_statistics",
    "make_independent",
    "positions",
    "restore_buffers",
    "snapshot_buffers",
]


class MixedExamplesError(ValueError):
    """A module mixes the examples of a batch, or learns from them: DP training is refused."""


@dataclass(frozen=True)
class Independence:
    """What the check found: modules whose statistics are frozen, and which it pinned."""

    frozen: tuple[str, ...]  # "'name' (Type)": every FrozenBatchNorm and pinned module
    pinned: tuple[str, ...]  # those this check pinned (not by freeze_batchnorm)
    examples: int
    mode: str  # "train": the mode DP training runs in; "eval": feature extraction
    batch_sizes: tuple[int, ...] = ()  # every size checked (`examples` first)


def batch_sizes(examples: int) -> tuple[int, int]:
    """`examples` and a size of the other parity beside it (6 -> 5, 7 -> 8)."""
    return examples, examples - 1 if examples % 2 == 0 else examples + 1


def positions(n: int) -> tuple[int, ...]:
    """The examples changed one at a time: the first (a reference example), one inside, the
    last."""
    return tuple(sorted({0, min(PERTURBED, n - 1), n - 1}))


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
    module that still mixes examples or learns from them.
    """
    if examples < 4:
        raise ValueError("the independence check needs at least 4 examples")
    device = _device(model)
    modes = {m: m.training for m in model.modules()}
    pinned: list[tuple[str, nn.Module]] = []
    refused: dict[nn.Module, str] = {}
    sizes = batch_sizes(examples)
    try:
        devices = [device] if device.type == "cuda" else []
        # a model already wrapped (the check at its first forward) records nothing meanwhile
        with (
            torch.random.fork_rng(devices=devices),
            full_fp32(),
            deterministic_kernels(),
            hooks_suspended(model),
        ):
            model.train(train)
            for k, n in enumerate(sizes):
                # beyond the first size the whole model is checked first (a module mixing at
                # this size shows there), module by module only to name what failed
                if k == 0 or _root_fault(model, sample_shape, dtype, device, n, train):
                    _check_size(model, sample_shape, dtype, device, n, train, pinned, refused)
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
            + "; ".join(refused.values())
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
        batch_sizes=sizes,
    )


def _root_fault(model, sample_shape, dtype, device, n, train) -> bool:
    with torch.no_grad():
        calls = _record_calls(model, _synthetic((n, *sample_shape), dtype, device))
    return model in calls and _fault(model, calls[model], n, train, train) is not None


def _check_size(model, sample_shape, dtype, device, n, train, pinned, refused) -> None:
    """Every module at batch size n, deepest first; fills `pinned` and `refused`."""
    with torch.no_grad():
        calls = _record_calls(model, _synthetic((n, *sample_shape), dtype, device))
    bad: set[nn.Module] = set(refused)  # refused, or containing a refused module
    for name, m in reversed(list(model.named_modules())):  # children first
        if m in bad or any(c in bad for c in m.children()):
            bad.add(m)  # named through its child
            continue
        if m not in calls:  # never called: nothing to check
            continue
        # gradients at the leaves and the whole model: a container's own backward mixing shows
        # at the root (named there); its forward is checked here like any module's
        grads = train and (m is model or next(m.children(), None) is None)
        why = _fault(m, calls[m], n, train, grads)
        if why is None:
            continue
        if train and _own_buffers(m) and not is_pinned(m):
            pin_eval(m)
            if _fault(m, calls[m], n, train, grads) is None:
                pinned.append((name, m))
                continue
            unpin(m)
        bad.add(m)
        refused[m] = f"{_label(name, m)}: {why} (batch of {n})"


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


def _reseed() -> None:
    """`torch.manual_seed(SEED)` for the generators a checked module can draw from: the CPU's,
    and CUDA's once initialised (`check` runs inside `fork_rng`, which restores both).

    Not `torch.manual_seed` itself: for every accelerator backend torch was built with but has
    not initialised (CUDA, XPU, MTIA on a CPU machine) it queues a lazy seeding together with
    the caller's formatted stack, ~0.6 ms each at a test's or a job's stack depth, and the check
    seeds about a thousand times (1.9 s of a 5 s privacy-suite test, cProfile, 2026-11-28).
    """
    torch.default_generator.manual_seed(SEED)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(SEED)


def _record_calls(model: nn.Module, x: torch.Tensor) -> dict[nn.Module, tuple]:
    """Each module's first (args, kwargs) in one forward of `model` on x; state restored."""
    calls: dict[nn.Module, tuple] = {}

    def keep(module, args, kwargs):
        calls.setdefault(module, (tree_map(detached, args), tree_map(detached, kwargs)))

    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in model.modules()]
    snap, attrs = snapshot_buffers(model), snapshot_attributes(model)
    try:
        _reseed()
        model(x)
    finally:
        for h in handles:
            h.remove()
        restore_buffers(snap)
        restore_attributes(attrs)
    return calls


class _Outcome:
    """One call of a module: its outputs, gradients, state after it, and what it changed."""

    def __init__(self, out, grads, state, changed):
        self.out, self.grads, self.state, self.changed = out, grads, state, changed


def _fault(m: nn.Module, call: tuple, n: int, train: bool, grads: bool) -> str | None:
    """Why `m` is not per-example in its current mode (None: it is); `grads`: its gradients
    too (training mode)."""
    rows = positions(n)
    train = train and grads
    # one forward of the recorded call; with gradients one backward per changed example
    base = _run(m, call, n, rows, train)
    if base.changed:
        return f"its forward changes its buffers ({', '.join(sorted(base.changed))})"
    for pos in rows:
        perturbed, any_row = _perturb(call, n, pos)
        if not any_row:
            return None
        if _zero_row_leaks(base.grads.get(pos, []), pos):
            return (
                f"example {pos + 1} of {n} gets an input gradient although its own output "
                "gradient is zero (the backward pass mixes examples)"
            )
        got = _run(m, perturbed, n, (pos,), train)
        if base.state.keys() != got.state.keys() or any(
            not same_values(v, got.state[k]) for k, v in base.state.items()
        ):
            return "it keeps tensors computed from its inputs (its state differs between calls)"
        if moved := _rows_moved(base.out, got.out, n, pos):
            return (
                f"its output for one example changes when another example of the batch "
                f"changes (example {pos + 1} of {n}; by {moved:.1e} of its scale)"
            )
        if moved := _grads_moved(base.grads.get(pos, []), got.grads.get(pos, []), n, pos):
            return (
                f"the gradients of the other examples change when example {pos + 1} of {n} "
                f"changes, its own output gradient zero (the backward pass mixes examples; by "
                f"{moved:.1e} of its scale)"
            )
    return None


def _run(m: nn.Module, call: tuple, n: int, zero_rows: tuple[int, ...], train: bool) -> _Outcome:
    """Call `m` on a copy of `call`, state restored after. In training mode, also, for each
    row in `zero_rows`, the gradients of its batch-first float inputs and trainable parameters
    for a random output gradient whose row is zero (one backward each, one forward)."""
    args, kwargs = tree_map(lambda v: _leaf(v, n, train), call)
    inputs = [v for v in tree_leaves((args, kwargs)) if torch.is_tensor(v) and v.requires_grad]
    args, kwargs = tree_map(_cloned, (args, kwargs))  # an in-place forward keeps the record
    snap, attrs = snapshot_buffers(m), snapshot_attributes(m)
    grads: dict[int, list] = {}
    try:
        _reseed()  # the same draws for every call (dropout's masks)
        with torch.set_grad_enabled(train):
            out = m(*args, **kwargs)
            if train:
                grads = {r: _gradients(m, out, inputs, n, r) for r in zero_rows}
        out = tree_map(lambda v: v.detach().clone() if torch.is_tensor(v) else v, out)
        state = attribute_values(m)
    finally:
        changed = restore_buffers(snap)
        restore_attributes(attrs)
    return _Outcome(out, grads, state, [k for names in changed.values() for k in names])


def _gradients(m: nn.Module, out: Any, inputs: list, n: int, zero_row: int) -> list:
    outs = [
        o
        for o in tree_leaves(out)
        if torch.is_tensor(o) and o.dim() > 0 and o.shape[0] == n and o.requires_grad
    ]
    wrt = inputs + [p for p in m.parameters() if p.requires_grad]
    if not outs or not wrt:
        return []
    gen = torch.Generator().manual_seed(SEED + 2)
    total = 0
    for o in outs:
        w = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
        w[zero_row] = 0
        total = total + (o * w).sum()
    got = torch.autograd.grad(total, wrt, allow_unused=True, retain_graph=True)
    # inputs' gradients: batch rows ("rows"); parameters': whole ("all")
    return [
        (("rows" if i < len(inputs) else "all"), g.detach().clone() if g is not None else None)
        for i, g in enumerate(got)
    ]


def _zero_row_leaks(grads: list, pos: int) -> bool:
    """A per-example module maps a zero output gradient of an example to a zero input
    gradient of that example (J_k^T 0 = 0): anything else came from the other examples."""
    for kind, g in grads:
        if kind == "rows" and g is not None:
            scale = max(float(g.abs().max()), 1.0)
            if float(g[pos].abs().max()) > TOLERANCE * scale:
                return True
    return False


def _rows_moved(a_tree: Any, b_tree: Any, n: int, pos: int) -> float:
    """The first change past the tolerance in the other examples' rows (0.0: none)."""
    for a, b in zip(tree_leaves(a_tree), tree_leaves(b_tree), strict=False):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
            continue
        if a.dim() == 0 or a.shape[0] != n or not a.is_floating_point():
            continue
        keep = torch.arange(n, device=a.device) != pos
        if moved := _moved(a[keep], b[keep]):
            return moved
    return 0.0


def _grads_moved(a: list, b: list, n: int, pos: int) -> float:
    """The first change past the tolerance in the other examples' gradients (0.0: none;
    inf: a gradient appeared or vanished)."""
    for (kind, ga), (_, gb) in zip(a, b, strict=True):
        if ga is None or gb is None:
            if (ga is None) != (gb is None):
                return float("inf")
            continue
        if kind == "rows":
            keep = torch.arange(n, device=ga.device) != pos
            ga, gb = ga[keep], gb[keep]
        if moved := _moved(ga, gb):
            return moved
    return 0.0


def _moved(ref: torch.Tensor, got: torch.Tensor) -> float:
    """The largest change in units of the reference's scale, if past `TOLERANCE` (else 0.0)."""
    ref, got = ref.double(), got.double()
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
    worst = float((got - ref).abs().max()) / scale if ref.numel() else 0.0
    return 0.0 if worst <= TOLERANCE else worst  # NaN (not <=) counts as moved


def _perturb(tree: Any, n: int, pos: int) -> tuple[Any, bool]:
    """`tree` with example `pos` changed in every batch-first tensor (other rows kept)."""
    gen = torch.Generator().manual_seed(SEED + 1)
    changed = False

    def one(v: Any) -> Any:
        nonlocal changed
        if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] != n:
            return v
        v = v.clone()
        if v.is_floating_point():
            fresh = torch.randn(v.shape[1:], generator=gen).to(v.device, v.dtype)
            v[pos] = fresh * 3 + 1
        else:  # ids, masks: another example's values are valid ones
            v[pos] = v[(pos + 1) % n]
        changed = True
        return v

    return tree_map(one, tree), changed


def _leaf(v: Any, n: int, grad: bool) -> Any:
    """A batch-first float input as a leaf whose gradient is asked for (when `grad`)."""
    if not torch.is_tensor(v):
        return v
    v = v.detach()
    if grad and v.is_floating_point() and v.dim() > 0 and v.shape[0] == n:
        return v.clone().requires_grad_()
    return v


def detached(v: Any) -> Any:
    return v.detach() if torch.is_tensor(v) else v


def _cloned(v: Any) -> Any:
    return v.clone() if torch.is_tensor(v) else v


# --- book-keeping's refusal: a trained module that mixes the examples of a batch -----------
def unsupported_trainable(model: nn.Module, trainable_only: bool = True) -> list[str]:
    """Names of modules holding (trainable) parameters that book-keeping cannot clip.

    Only a BatchNorm in training mode (it mixes the examples); every other module is clipped,
    by a closed form or by torch.func (module docstring).
    """
    out = []
    for name, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        if trainable_only:
            own = [p for p in own if p.requires_grad]
        if own and mixes_examples(m):
            out.append(f"{name or '<root>'} ({type(m).__name__} in training mode)")
    return out


def mixes_examples(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training


def refuse_unsupported(model: nn.Module) -> None:
    bad = unsupported_trainable(model)
    if bad:
        raise ValueError(
            "grad_sample_mode 'bk' cannot clip the trainable parameters of: "
            + ", ".join(bad)
            + " (its output mixes the examples of a batch; put it in eval mode to use its "
            "running statistics, or replace it by GroupNorm)"
        )
