"""Where the self-test's margin went: each module's worst example, for the mode and the reference.

Why: the self-test judges a module by its worst example's relative norm error, and its record
keeps only the module that decided. When a device uses most of the tolerance on a right mode
(issue 66: bk's norms at GNResNet-10's `layers.3.gn1` used 80 % of it on an H200 at the
Table 2 batch, 2 % on the CPU), what names the kernel is the per-module picture: at which
modules the mode is off, on which example, whether the torch.func reference in the working
dtype is off there as well (the device's arithmetic for that layer, whatever computes it) or
only the mode is (the mode's own kernel), and how small that example's gradient at the module
is against its whole gradient (cancellation in a nearly-zero per-example gradient). One loan's
record then says which of those it is.

The relative error is the self-test's: `|n_i - r_i| / max(r_i, FLOOR R_i)` against the float64
reference r_i, R_i the example's whole norm (`relative_errors`, shared with `self_test`).
"""

from __future__ import annotations

import torch


def relative_errors(
    norms: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], floor: float
) -> dict[str, torch.Tensor]:
    """Per module, each example's |norms - ref| relative to max(ref, floor x whole ref norm)."""
    whole = torch.sqrt(sum(v.pow(2) for v in ref.values()))
    tiny = torch.finfo(torch.float64).tiny
    out = {}
    for mod, rv in ref.items():
        scale = torch.maximum(rv, floor * whole).clamp(min=tiny)
        out[mod] = (norms[mod].double().cpu() - rv).abs() / scale
    return out


def worst_examples(
    ref_norms: dict[str, torch.Tensor],
    ref_working: dict[str, torch.Tensor],
    measured: dict[str, torch.Tensor],
    floor: float,
    how: dict[str, str] | None = None,
) -> dict[str, dict]:
    """Per module: the mode's worst relative norm error and its example, the working-dtype
    reference's worst and its example, and at the mode's worst example the module's reference
    norm and that example's whole norm; `how` (module -> the mode's strategy there) where the
    mode says how it computed each layer (bk's `last_plan`)."""
    whole = torch.sqrt(sum(v.pow(2) for v in ref_norms.values()))
    ref_err = relative_errors(ref_working, ref_norms, floor) if ref_working else {}
    out: dict[str, dict] = {}
    for mod, rel in measured.items():
        i = _argmax(rel)
        row = {
            "mode_error": _at(rel, i),
            "mode_example": i,
            "norm": _at(ref_norms[mod], i),
            "whole_norm": _at(whole, i),
        }
        if mod in ref_err:
            j = _argmax(ref_err[mod])
            row.update(reference_error=_at(ref_err[mod], j), reference_example=j)
            row["reference_error_at_mode_example"] = _at(ref_err[mod], i)
        if how and mod in how:
            row["how"] = how[mod]
        out[mod] = row
    return out


def _argmax(t: torch.Tensor) -> int:
    """The worst example (nan counts as worst); -1 for none."""
    if not t.numel():
        return -1
    t = torch.where(torch.isnan(t), torch.full_like(t, float("inf")), t)
    return int(t.argmax())


def _at(t: torch.Tensor, i: int) -> float:
    return float(t[i]) if i >= 0 else 0.0
