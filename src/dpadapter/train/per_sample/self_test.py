"""The per-sample self-test run when a model is wrapped for DP (`finetune.per_sample_check`).

Each example's clipped contribution is only bounded by C if its gradient norm is the true one:
a per-sample mode that computes a wrong norm for some layer (an Opacus grad sampler that
mishandles a layout, a closed form applied to a subclass that changed the forward) breaks the
sensitivity the accountant assumes, silently. Before any private step, the mode's per-example
gradient norms for three synthetic examples are compared, module by module, with a torch.func
reference (`grad` of each example's own loss, over the model's trainable parameters); a
mismatch refuses to train and names the module.

What it does not touch: private data (inputs are drawn from a private generator in the
training data's sample shape, labels from the model's output size), the global RNG (forked),
the model's parameters, modes or per-sample state (`p.grad`, `p.grad_sample`, Opacus'
activations, bk's records and plan are restored). The forward runs in eval mode except for the
modules that own trainable parameters, which Opacus' hooks only record in training mode (a
BatchNorm stays in eval: it would mix the examples); so dropout draws nothing. Everything runs
in full FP32 (`device.full_fp32`): the reference and the mode use different kernels, and under
TF32 they could differ by ~1e-3 for right gradients.

Tolerance: a relative error of 1e-3 (`TOLERANCE`): rounding differences between right
implementations are ~1e-6 in FP32, a wrong per-example gradient is off by O(1) (the channels-
last bug of Opacus' hooks mode: 1.4). The error of a module is `max_i |n_i - r_i| / R_i`: its
norm n_i against the reference r_i, relative to the example's whole reference norm R_i (so a
module with a tiny gradient is not flagged for rounding), and the whole norms are compared
the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from dpadapter.device import full_fp32

TOLERANCE = 1e-3
EXAMPLES = 3
SEED = 0x5E1F7E57  # the inputs' private generator: nothing else draws from it


class PerSampleCheckError(RuntimeError):
    """The per-sample mode's gradient norms disagree with the reference: training is refused."""


def run_check(
    model: nn.Module,
    wrap: Callable[[], nn.Module],
    mode: str,
    sample_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    examples: int | None = None,
    tolerance: float = TOLERANCE,
) -> tuple[nn.Module, dict[str, Any]]:
    """Wrap `model` by `wrap()` and check the wrapped module's per-example norms.

    Returns (wrapped, record for metrics.json); raises PerSampleCheckError on a mismatch.
    """
    examples = examples or EXAMPLES
    groups = _trained_groups(model)
    if not groups:
        return wrap(), _record(mode, 0, 0.0, tolerance, "")
    param = next(p for ps in groups.values() for p in ps)
    devices = [param.device] if param.device.type == "cuda" else []
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.random.fork_rng(devices=devices), full_fp32():
            gen = torch.Generator().manual_seed(SEED)
            x = torch.randn((examples, *sample_shape), generator=gen).to(param.device, dtype)
            _eval_but_trained(model)
            with torch.no_grad():
                classes = model(x).shape[-1]
            y = torch.randint(0, classes, (examples,), generator=gen).to(param.device)
            ref = _reference_norms(model, groups, x, y)
            wrapped = wrap()  # what wrapping adds (hooks, Opacus' attributes) stays
            with _restored(model):  # the mode's per-sample state is dropped after
                got = _mode_norms(wrapped, groups, x, y)
    finally:
        for m, training in modes.items():
            m.training = training
    err, worst = _compare(ref, got)
    record = _record(mode, examples, err, tolerance, worst)
    if not err <= tolerance:
        if hasattr(wrapped, "_close"):
            wrapped._close()
        raise PerSampleCheckError(
            f"per-sample self-test: grad_sample_mode {mode!r} gives per-example gradient norms "
            f"off by {err:.3g} (relative; tolerance {tolerance:g}) at {worst}; training refused "
            "(another grad_sample_mode may compute them right; finetune.per_sample_check: false "
            "skips this test)"
        )
    return wrapped, record


def _record(mode: str, examples: int, err: float, tolerance: float, worst: str) -> dict:
    return {
        "mode": mode,
        "examples": examples,
        "max_rel_error": err,
        "tolerance": tolerance,
        "passed": err <= tolerance,
        "worst": worst or None,
    }


def _trained_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by the module that owns them: "module 'name' (Class)"."""
    out = {}
    for name, m in model.named_modules():
        ps = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if ps:
            out[f"module {name or '<root>'!r} ({type(m).__name__})"] = ps
    return out


def _eval_but_trained(model: nn.Module) -> None:
    for m in model.modules():
        trained = any(p.requires_grad for p in m.parameters(recurse=False))
        m.training = trained and not isinstance(m, nn.modules.batchnorm._BatchNorm)


def _reference_norms(model, groups, x, y) -> dict[str, torch.Tensor]:
    """{module: (n,) norms} from torch.func's gradient of each example's own loss."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = {names[id(p)]: p.detach() for ps in groups.values() for p in ps}

    def loss(q, xi, yi):
        return F.cross_entropy(functional_call(model, q, (xi[None],)), yi[None])

    per = [grad(loss)(params, x[i], y[i]) for i in range(len(y))]
    return {
        mod: torch.stack([_norm([g[names[id(p)]] for p in ps]) for g in per])
        for mod, ps in groups.items()
    }


def _mode_norms(wrapped, groups, x, y) -> dict[str, torch.Tensor]:
    """{module: (n,) norms} as the wrapped mode computes them for clipping."""
    from dpadapter.train.per_sample.bookkeeping import BookKeepingModule

    F.cross_entropy(wrapped(x), y).backward()
    if isinstance(wrapped, BookKeepingModule):
        with torch.no_grad():
            out = {mod: wrapped.per_sample_norms(ps) for mod, ps in groups.items()}
        wrapped.clear()
        wrapped.last_plan = {}
        wrapped.workspace.clear()
        return out
    out = {}
    for mod, ps in groups.items():
        gs = [getattr(p, "grad_sample", None) for p in ps]
        if any(not isinstance(g, torch.Tensor) for g in gs):
            out[mod] = torch.full((len(y),), float("nan"), device=x.device)
        else:
            out[mod] = torch.stack([_norm([g[i] for g in gs]) for i in range(len(y))])
    return out


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum(t.detach().double().pow(2).sum() for t in tensors))


def _compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    total_ref = torch.sqrt(sum(r.double().pow(2) for r in ref.values()))
    total_got = torch.sqrt(sum(g.double().pow(2) for g in got.values()))
    scale = total_ref.clamp(min=torch.finfo(torch.float64).tiny)
    errs = {
        mod: float(((got[mod].double() - r.double()).abs() / scale).max()) for mod, r in ref.items()
    }
    errs["the whole gradient"] = float(((total_got - total_ref).abs() / scale).max())
    errs = {k: (float("inf") if v != v else v) for k, v in errs.items()}  # nan: none computed
    worst = max(errs, key=lambda k: (errs[k], k != "the whole gradient"))
    return errs[worst], worst


@contextmanager
def _restored(model: nn.Module):
    """Every module's and parameter's Python attributes, `p.grad` and `requires_grad` after.

    (Opacus keeps its per-sample state there: `p.grad_sample`, `p._forward_counter`,
    `module.activations`, `module.max_batch_len`.)
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
