"""The per-sample self-test run when a model is wrapped for DP (`finetune.per_sample_check`).

Each example's clipped contribution is only bounded by C if its gradient norm is the true one
and the released sum is the sum of what was clipped: a per-sample mode that computes a wrong
norm for some layer (an Opacus grad sampler that mishandles a layout, a closed form applied to
a subclass that changed the forward) or a wrong clipped sum breaks the sensitivity the
accountant assumes, silently. So before any private step the test compares, module by module,
what the mode computes with a torch.func reference (`grad` of each example's own loss over the
model's trainable parameters, under `vmap` in chunks):

- the per-example gradient norms;
- the clipped sums `sum_i c_i g_i`, as the DP optimizer made by `make_optimizer` releases them
  (Opacus' `clip_and_accumulate`, or bk's), at a clip bound C that clips about half of the examples
  (the median reference norm of the first chunk) so both branches of the clip run;
- each example's norms again after another example of the batch is changed: they must not
  move (a per-sample mode that lets examples interact, or a layer that mixes them in its
  backward, would).

It runs on as many synthetic examples as a physical batch will hold (`examples`: dp_fit passes
the configured physical batch size, or the expected batch), so the code paths chosen by batch
size (bk keeps per-example gradients for the sum below `keep_elements`, recomputes them above)
are the ones tested. The modules run in the mode they train in (`model.train()`; whatever
`independence` pinned stays in eval), except the ones that draw random numbers (dropout): a
per-example reference cannot draw a batch's masks, so those are compared in eval mode (found by
their effect on the RNG state, whatever their class; listed in the record).

Error of a module: `max_i |n_i - r_i| / max(r_i, FLOOR R_i)`, its norm n_i against the float64
reference r_i relative to the module's own reference norm, floored at `FLOOR` of the example's
whole norm R_i (a module with no gradient for an example is not judged by rounding alone); its
clipped sum `|S - S_ref| / max(sum_i c_i r_i, FLOOR sum_i c_i R_i)` (the bound on that module's
share of the sum, which cancellation between examples cannot shrink). Before an error is
judged, the module's own measured rounding is allowed for, `ROUNDING_MARGIN` times how far the
reference itself moves between float64 and the working dtype (`reference`): where a module's
gradient is the small difference of large terms, right implementations differ by that much.
Tolerance 1e-3 (`TOLERANCE`) beyond that allowance: a wrong per-example gradient is off by O(1)
(the channels-last bug of Opacus' hooks mode: 1.4). The record keeps the three apart (the
errors as measured, the allowance at the deciding check, the tolerance): an error with the
allowance already taken off reads 0.0 on every right model and says nothing about how close
the mode came.

Kinks: where an input sits within rounding of a point where the gradient jumps (two max-pool
inputs tied, a ReLU input at 0), float32 and float64 can take different subgradients, and one
example's early layers then differ by far more than rounding (0.5% at a GroupNorm behind a tied
max-pool, seen on a trained CNN and synthetic inputs, in bk, hooks and functorch alike). A wrong
mode is wrong for most examples; a kink hits one in hundreds. So when at most 1 in `KINK_SHARE`
examples (at least one) is off and every other example is right, those examples are moved by
`KINK_STEP` (off the kink: the tie is broken by far more than rounding) and the whole test runs
again, once; it must pass then. The record says how many were moved.

What it does not touch: private data (inputs from a private generator in the training data's
sample shape, labels from the model's output size), the global RNG (forked), the model's
parameters, buffers, modes or per-sample state (`p.grad`, `p.grad_sample`, `p.summed_grad`,
Opacus' activations, bk's records and plan are restored). Everything runs in full FP32
(`device.full_fp32`): under TF32 the reference and the mode could differ by ~1e-3 for right
gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.ground.device import full_fp32
from dpadapter.per_sample.margins import relative_errors, worst_examples
from dpadapter.per_sample.module_state import restore_buffers, snapshot_buffers
from dpadapter.per_sample.reference import Reference, reference

TOLERANCE = 1e-3
FLOOR = 1e-5
ROUNDING_MARGIN = 10.0  # times each module's measured float32-vs-float64 rounding
# At most 1 in KINK_SHARE examples off (at least one) and the rest right: moved by KINK_STEP
# (inputs ~ N(0, 1)) and tested again, once (module docstring: kinks).
KINK_SHARE = 50
KINK_STEP = 1e-3
EXAMPLES = 8  # when no physical batch size is given
SMALL = 5  # the second size checked: small and odd (a Poisson batch, a remainder, a rank's)
SEED = 0x5E1F7E57  # the inputs' private generator: nothing else draws from it
WHOLE = "the whole gradient"


class PerSampleCheckError(RuntimeError):
    """The per-sample mode's norms or sums disagree with the reference: training is refused.

    `record` is the refused test's record (as metrics.json would have had it), so that a
    caller that reports rather than trains (bench/gpu/gpu_self_test.py) keeps its figures."""

    record: dict | None = None


class Reading(NamedTuple):
    """One check's relative error as measured, the rounding allowed for it, and what is left.

    `beyond` is what the tolerance judges; it is computed once, here, so the verdict does not
    depend on how a reader recombines the other two."""

    measured: float
    allowance: float
    beyond: float


def run_checks(
    model: nn.Module,
    wrap: Callable[[], nn.Module],
    make_optimizer: Callable[..., DPOptimizer],
    mode: str,
    sample_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    examples: int | None = None,
    tolerance: float = TOLERANCE,
) -> tuple[nn.Module, dict[str, Any]]:
    """`run_check` at two batch sizes: the physical one and a small odd one (`SMALL`).

    Poisson batches, the remainder of a logical batch split into physical ones and a rank's
    share of a batch reach sizes far from the physical one, and bk picks its code path by the
    batch size (ghost norm or materialised gradients): one size alone tests one path. The
    record is the physical size's, with the small size's verdict under `also_at`.
    """
    n = max(2, examples or EXAMPLES)
    small = SMALL if n != SMALL else SMALL + 2
    first, at_small = run_check(
        model, wrap, make_optimizer, mode, sample_shape, dtype, small, tolerance
    )
    if hasattr(first, "_close"):
        first._close()
    wrapped, record = run_check(
        model, wrap, make_optimizer, mode, sample_shape, dtype, n, tolerance
    )
    keep = ("examples", "max_rel_error", "worst_rel_error", "rounding_allowance", "passed", "worst")
    record["also_at"] = {k: at_small[k] for k in keep}
    return wrapped, record


def run_check(
    model: nn.Module,
    wrap: Callable[[], nn.Module],
    make_optimizer: Callable[..., DPOptimizer],
    mode: str,
    sample_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    examples: int | None = None,
    tolerance: float = TOLERANCE,
) -> tuple[nn.Module, dict[str, Any]]:
    """Wrap `model` by `wrap()` and check what the wrapped module's clipping computes.

    `make_optimizer` (`optimizers.dp_optimizer`) makes a DP optimizer that clips the way the
    wrapped module records gradients, as training makes it. Returns (wrapped, record for
    metrics.json); raises PerSampleCheckError.
    """
    n = max(2, examples or EXAMPLES)
    groups = _trained_groups(model)
    if not groups:
        return wrap(), _record(mode, 0, {}, tolerance, [])
    param = next(p for ps in groups.values() for p in ps)
    devices = [param.device] if param.device.type == "cuda" else []
    modes = {m: m.training for m in model.modules()}
    buffers = snapshot_buffers(model)
    redrawn: list[int] = []
    try:
        with torch.random.fork_rng(devices=devices), full_fp32():
            gen = torch.Generator().manual_seed(SEED)
            x = _synthetic((n, *sample_shape), dtype, gen).to(param.device)
            model.train()  # the mode it trains in (pinned modules stay in eval)
            drawing = _random_modules(model, x)
            for m in drawing.values():
                m.training = False
            with torch.no_grad():
                classes = model(x).shape[-1]
            y = torch.randint(0, classes, (n,), generator=gen).to(param.device)
            other = _synthetic(x.shape[1:], dtype, gen).to(param.device) * 3 + 1
            wrapped, errors, failing = _attempt(
                model, wrap, make_optimizer, groups, x, y, other, tolerance
            )
            if failing and len(failing) <= max(1, n // KINK_SHARE):
                # A few examples off, the rest exact: most likely inputs within rounding of a
                # kink (a max-pool tie, a ReLU at 0), where float32 and float64 take different
                # subgradients. Move those examples off it and test everything again.
                if hasattr(wrapped, "_close"):
                    wrapped._close()
                redrawn = failing
                idx = torch.tensor(failing, device=x.device)
                step = torch.randn(x[idx].shape, generator=gen).to(x.device, x.dtype)
                if x.is_floating_point():
                    x = x.clone()
                    x[idx] += KINK_STEP * step
                wrapped, errors, failing = _attempt(
                    model, wrap, make_optimizer, groups, x, y, other, tolerance
                )
    finally:
        for m, training in modes.items():
            m.training = training
        restore_buffers(buffers)
    ref_dtype = errors.pop(_REF_DTYPE)
    by_module = errors.pop(_BY_MODULE)
    record = _record(mode, n, errors, tolerance, sorted(drawing))
    record["by_module"] = by_module  # each module's worst example (`margins`)
    record.update(reference=ref_dtype, rounding_margin=ROUNDING_MARGIN)
    record["redrawn_near_kinks"] = len(redrawn)
    if not record["passed"]:
        if hasattr(wrapped, "_close"):
            wrapped._close()
        kind, where = record["worst"].split(" at ", 1)
        error = PerSampleCheckError(
            f"per-sample self-test: grad_sample_mode {mode!r} gives {kind} off by "
            f"{record['worst_rel_error']:.3g} (relative; {record['rounding_allowance']:.3g} of "
            f"it allowed for measured rounding, tolerance {tolerance:g} beyond) at {where}"
            + (f" (also after moving {len(redrawn)} example(s) off a kink)" if redrawn else "")
            + "; training refused: a wrong per-example norm or sum breaks the bound the "
            "accountant assumes (another finetune.grad_sample_mode may compute them right)"
        )
        error.record = record
        raise error
    return wrapped, record


_REF_DTYPE = "reference dtype"
_BY_MODULE = "by module"


def _attempt(model, wrap, make_optimizer, groups, x, y, other, tolerance):
    """Reference, wrap, the mode's norms and sums: (wrapped, errors, examples off).

    `other` replaces the middle example for the check that examples do not interact."""
    n = len(y)
    x2 = x.clone()
    x2[n // 2] = other
    ref = reference(model, groups, x, y, FLOOR)
    wrapped = wrap()  # what wrapping adds (hooks, Opacus' attributes) stays
    with _restored(model):  # the mode's per-sample state is dropped after
        got = _mode_run(wrapped, make_optimizer, groups, x, y, ref.clip)
    with _restored(model):
        moved = _mode_run(wrapped, None, groups, x2, y, None)
    errors = _compare(ref, got, moved, n // 2)
    failing = _failing_examples(ref, got, tolerance)
    errors_ok = max((e.beyond for e in errors.values()), default=0.0) <= tolerance
    how = {mod: got["how"][name] for mod, name in _names(groups).items() if name in got["how"]}
    by_module = worst_examples(
        ref.norms, ref.norms_working, _module_norm_measured(ref, got), FLOOR, how
    )
    extra = {_REF_DTYPE: ref.dtype, _BY_MODULE: by_module}
    return wrapped, {**errors, **extra}, ([] if errors_ok else failing)


def _names(groups: dict) -> dict[str, str]:
    """Each group's module name as bk's `last_plan` keys it ("module 'a.b' (Class)" -> a.b)."""
    return {mod: mod.split("'")[1] for mod in groups}


def _failing_examples(ref: Reference, got: dict, tolerance: float) -> list[int]:
    """The examples whose norm at some module is off beyond the tolerance."""
    bad = torch.zeros(len(next(iter(ref.norms.values()))), dtype=torch.bool)
    for rel in _module_norm_errors(ref, got).values():
        bad |= ~(rel <= tolerance)  # nan counts as off
    return [int(i) for i in bad.nonzero().flatten()]


def _module_norm_errors(ref: Reference, got: dict) -> dict[str, torch.Tensor]:
    """Per module, each example's relative norm error less the module's measured rounding."""
    return {
        mod: rel - ROUNDING_MARGIN * ref.norm_noise[mod]
        for mod, rel in _module_norm_measured(ref, got).items()
    }


def _module_norm_measured(ref: Reference, got: dict) -> dict[str, torch.Tensor]:
    """Per module, each example's relative norm error as measured (nothing allowed for)."""
    return relative_errors(got["norms"], ref.norms, FLOOR)


def _record(mode, examples, errors: dict[str, Reading], tolerance, drawing) -> dict:
    """metrics.json's `per_sample_check`: every error as measured, the allowance and the
    tolerance beside them, so a reader sees how close a right mode came (`passed` is
    `worst_rel_error - rounding_allowance <= tolerance`, at the check `worst` names)."""
    # The check nearest to failing: what decides, then (all within their allowance, as on a
    # right mode) the least headroom, so `worst` and its two figures say how close it came.
    worst = max(
        errors,
        key=lambda k: (errors[k].beyond, errors[k].measured - errors[k].allowance, WHOLE not in k),
        default="",
    )
    at_worst = errors.get(worst, Reading(0.0, 0.0, 0.0))
    by_kind = {}
    for kind in ("per-example norms", "clipped sums", "norms after another example changed"):
        vals = [v.measured for k, v in errors.items() if k.startswith(kind + " ")]
        by_kind[kind.split(" ")[0] if kind != "clipped sums" else "sums"] = max(vals, default=0.0)
    return {
        "mode": mode,
        "examples": examples,
        "max_rel_error": max((v.measured for v in errors.values()), default=0.0),
        "norm_error": by_kind["per-example"],
        "sum_error": by_kind["sums"],
        "independence_error": by_kind["norms"],
        "worst_rel_error": at_worst.measured,
        "rounding_allowance": at_worst.allowance,
        "tolerance": tolerance,
        "passed": at_worst.beyond <= tolerance,
        "worst": worst or None,
        "eval_in_check": drawing,
    }


def _synthetic(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 2, shape, generator=gen).to(dtype)


def _trained_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by the module that owns them: "module 'name' (Class)". A tied
    parameter (`shared`) is its first holder's only: one optimizer parameter, one gradient."""
    out: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for name, m in model.named_modules():
        ps = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            out[f"module {name or '<root>'!r} ({type(m).__name__})"] = ps
    return out


def _random_modules(model: nn.Module, x: torch.Tensor) -> dict[str, nn.Module]:
    """The innermost modules whose training-mode forward draws from the RNG (dropout)."""
    cuda = x.device.type == "cuda"

    def state() -> list[torch.Tensor]:
        return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(x.device)] if cuda else [])

    open_calls: dict[nn.Module, list[list[torch.Tensor]]] = {}
    drew: set[nn.Module] = set()

    def pre(m, args):
        open_calls.setdefault(m, []).append(state())

    def post(m, args, out):
        before = open_calls[m].pop()
        if any(not torch.equal(a, b) for a, b in zip(before, state(), strict=True)):
            drew.add(m)

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    snap = snapshot_buffers(model)
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
        restore_buffers(snap)
    return {
        name or "<root>": m
        for name, m in model.named_modules()
        if m in drew and not any(c in drew for c in m.modules() if c is not m)
    }


def _rows_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n,) norms of the rows of several (n, ...) tensors together, in float64."""
    return torch.sqrt(sum(t.detach().double().flatten(1).pow(2).sum(1) for t in tensors))


def _mode_run(wrapped, make_optimizer, groups, x, y, clip) -> dict[str, Any]:
    """{norms: {module: (n,)}, sums: {module: [summed_grad]}} as the wrapped mode computes
    them: one forward/backward on the batch, the norms, then (with `make_optimizer`) the
    clipped sums of a noiseless DP optimizer made as training makes it."""
    from dpadapter.per_sample.bookkeeping import BookKeepingModule

    params = [p for ps in groups.values() for p in ps]
    F.cross_entropy(wrapped(x), y).backward()
    bk = isinstance(wrapped, BookKeepingModule)
    with torch.no_grad():
        if bk:
            norms = {mod: wrapped.per_sample_norms(ps).double().cpu() for mod, ps in groups.items()}
        else:
            norms = {mod: _opacus_norms(ps, len(y)) for mod, ps in groups.items()}
    how = _strategies(wrapped) if bk else {}
    sums = None
    if make_optimizer is not None and all(v.isfinite().all() for v in norms.values()):
        opt = make_optimizer(
            DPOptimizer,
            wrapped,
            torch.optim.SGD(params, lr=0.0),
            noise_multiplier=0.0,
            max_grad_norm=clip,
            expected_batch_size=len(y),
        )
        opt.clip_and_accumulate()
        sums = {mod: [p.summed_grad.detach().double() for p in ps] for mod, ps in groups.items()}
    if bk:
        wrapped.clear()
        wrapped.last_plan = {}
        if wrapped.workspace is not None:
            wrapped.workspace.clear()
    return {"norms": norms, "sums": sums, "how": how}


def _strategies(bk) -> dict[str, str]:
    """Module name -> how bk computed its norms (`LayerRecord.strategy`; "+fused": from the
    layer's own backward kernel, `norm_fusion`), read before the records are cleared."""
    names = {m: name or "<root>" for name, m in bk._module.named_modules()}
    return {
        names.get(r.module, "?"): r.strategy + ("+fused" if getattr(r, "per_example", ()) else "")
        for r in bk.records.values()
    }


def _opacus_norms(ps: list[nn.Parameter], n: int) -> torch.Tensor:
    gs = [getattr(p, "grad_sample", None) for p in ps]
    if any(not isinstance(g, torch.Tensor) for g in gs):
        return torch.full((n,), float("nan"), dtype=torch.float64)
    return _rows_norm(gs).cpu()


def _compare(ref: Reference, got: dict, moved: dict, changed: int) -> dict[str, Reading]:
    """Every relative error, keyed "<what> at <where>" (module docstring for the formulas)."""
    out: dict[str, Reading] = {}
    r, n = ref.norms, got["norms"]
    whole_r = torch.sqrt(sum(v.pow(2) for v in r.values()))
    whole_n = torch.sqrt(sum(v.pow(2) for v in n.values()))
    tiny = torch.finfo(torch.float64).tiny
    measured = _module_norm_measured(ref, got)
    for mod, rel in _module_norm_errors(ref, got).items():
        out[f"per-example norms at {mod}"] = Reading(
            _max(measured[mod]), ROUNDING_MARGIN * ref.norm_noise[mod], max(0.0, _max(rel))
        )
    out[f"per-example norms at {WHOLE}"] = _beyond(
        (whole_n - whole_r).abs() / whole_r.clamp(tiny), ref.whole_noise
    )
    if got["sums"] is None:
        inf = float("inf")  # not computed: norms were not finite
        out[f"clipped sums at {WHOLE}"] = Reading(inf, 0.0, inf)
    else:
        total = sum(ref.shares.values())
        for mod, want in ref.sums.items():
            pairs = zip(got["sums"][mod], want, strict=True)
            diff = float(torch.sqrt(sum((a.cpu() - b.cpu()).pow(2).sum() for a, b in pairs)))
            scale = max(ref.shares[mod], FLOOR * total, tiny)
            allowed = ROUNDING_MARGIN * ref.sum_noise[mod]
            left = max(0.0, diff - allowed)
            finite = diff == diff
            out[f"clipped sums at {mod}"] = Reading(
                diff / scale if finite else float("inf"),
                allowed / scale,
                left / scale if finite else float("inf"),
            )
    keep = torch.arange(len(whole_n)) != changed
    m = moved["norms"]
    for mod, nv in n.items():
        scale = torch.maximum(nv, FLOOR * whole_n).clamp(min=tiny)
        out[f"norms after another example changed at {mod}"] = _beyond(
            ((m[mod] - nv).abs() / scale)[keep], ref.norm_noise[mod]
        )
    return out


def _beyond(rel: torch.Tensor, noise: float) -> Reading:
    """The largest relative error, and what is left once the measured rounding is allowed for."""
    allowed = ROUNDING_MARGIN * noise
    return Reading(_max(rel), allowed, max(0.0, _max(rel) - allowed))


def _max(t: torch.Tensor) -> float:
    v = float(t.max()) if t.numel() else 0.0
    return float("inf") if v != v else v  # nan: none computed


@contextmanager
def _restored(model: nn.Module):
    """Every module's and parameter's Python attributes, `p.grad` and `requires_grad` after.

    (Opacus keeps its per-sample state there: `p.grad_sample`, `p.summed_grad`,
    `p._forward_counter`, `module.activations`, `module.max_batch_len`.)
    """
    mods = [(m, dict(m.__dict__), _lists(m.__dict__)) for m in model.modules()]
    params = [(p, dict(p.__dict__), p.grad, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for m, saved, lists in mods:
            for k in [k for k in m.__dict__ if k not in saved]:
                del m.__dict__[k]
            m.__dict__.update(saved)
            for k, items in lists.items():
                m.__dict__[k][:] = items
        for p, saved, g, rg in params:
            p.__dict__.clear()
            p.__dict__.update(saved)
            p.grad = g
            p.requires_grad_(rg)


def _lists(d: dict) -> dict[str, list]:
    return {k: list(v) for k, v in d.items() if type(v) is list}
