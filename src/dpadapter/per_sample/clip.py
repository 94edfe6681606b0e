"""The clip factor of every per-example clipping in the pipeline, in one place.

Each mechanism's sensitivity rests on `c_i * |g_i| <= C`. The factor is Opacus' own
(`DPOptimizer.clip_and_accumulate`): min(1, C / (|g_i| + 1e-6)), so that book-keeping, GEP's two
clips, AdpClip, the federated clients, the T1 estimate and the linear probe scale a gradient
exactly as Opacus' modes do. The 1e-6 only lowers a factor, so the bound holds for any norm,
including zero.
"""

from __future__ import annotations

import torch

STABILIZER = 1e-6


def clip_factors(norms: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """Per-example factors c_i = min(1, C / (norm_i + 1e-6)) that bring each norm within C."""
    return (max_norm / (norms + STABILIZER)).clamp(max=1.0)
