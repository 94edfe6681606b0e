"""The clip of every per-example clipping in the pipeline, in one place: norms and factors.

Each mechanism's sensitivity rests on `c_i * |g_i| <= C`. The factor is Opacus' own
(`DPOptimizer.clip_and_accumulate`): min(1, C / (|g_i| + 1e-6)), so that book-keeping, GEP's two
clips, AdpClip, the federated clients (l2 Gaussian, l1 Laplace), the T1 estimate and the linear
probe scale a gradient exactly as Opacus' modes do. The 1e-6 only lowers a factor, so the bound
holds for any norm, including zero. The norm is l2 for the Gaussian mechanisms and l1 for the
Laplace one (`per_example_norms`: Opacus has l2 only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

STABILIZER = 1e-6
NORMS = ("l2", "l1")


def clip_factors(norms: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """Per-example factors c_i = min(1, C / (norm_i + 1e-6)) that bring each norm within C."""
    return (max_norm / (norms + STABILIZER)).clamp(max=1.0)


def per_example_norms(grads: Sequence[torch.Tensor], norm: str = "l2") -> torch.Tensor:
    """(n,) each example's gradient norm over several (n, ...) per-example gradient tensors:
    per tensor the sum over an example's entries (of squares for l2, of magnitudes for l1),
    then over the tensors."""
    flat = [g.reshape(len(g), -1) for g in grads]
    if norm == "l2":
        return torch.stack([g.pow(2).sum(1) for g in flat], 1).sum(1).sqrt()
    if norm == "l1":
        return torch.stack([g.abs().sum(1) for g in flat], 1).sum(1)
    raise ValueError(f"unknown norm {norm!r}; known: {NORMS}")


def folded_rows_error(what: str, rows: int | None) -> RuntimeError:
    """The refusal of a trained layer whose rows are not the batch's examples (`what` says
    where it was seen), for every per-sample mode that takes rows as examples."""
    return RuntimeError(
        f"{what}, not one row per example of the batch of {rows}: a trained layer is fed the "
        "examples folded into its rows (windows, flattened tokens), and clipping its rows would "
        "not bound each example (one could move the release by k times the bound). No "
        "per-layer mode (bk, hooks, ew, functorch) clips such a layer per example; freeze it "
        "(finetune.strategy: ht) or use a backbone whose trained layers see batch-first inputs"
    )
