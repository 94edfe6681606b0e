"""Full-batch DP-GD of K zero-initialised linear heads at once, on precomputed features:

    g_t = (sum_i clip_C(grad l(x_i, w_t)) + sigma * C * xi_t) / n,   v_t = rho v_{t-1} + g_t,
    w_{t+1} = w_t - lr * v_t,

with n the (public) size of the training split.

The per-example gradient of a bias-free linear softmax head is (p_i - y_i) x_i^T, whose norm is
|p_i - y_i| |x_i|, so clipping and summing is two matrix products and K runs (grid points,
seeds) train in one batched loop. Opacus would compute the same per-sample gradients one run at
a time through hooks; the HPO needs several hundred runs, so this closed form is written here by
hand (it is checked against autograd in the tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dpadapter.hpo.probe.features import Split
from dpadapter.per_sample.clip import clip_factors
from dpadapter.privacy import randomness


@dataclass(frozen=True)
class Run:
    """One full-batch DP-GD run: T steps at lr with per-step noise multiplier sigma."""

    lr: float
    steps: int
    sigma: float
    seed: int


def clipped_grad_sum(
    x: torch.Tensor,
    y1: torch.Tensor,
    w: torch.Tensor,
    clip: float,
    x_norm: torch.Tensor | None = None,
):
    """Sum over examples of per-example gradients clipped to l2 norm `clip`, for K heads.

    x (n, d), y1 (n, c) one-hot, w (K, d, c) -> (K, d, c). Cross-entropy gradient of example i
    for head k is x_i (p_ki - y_i)^T, with norm |x_i| |p_ki - y_i|. The K heads are laid side by
    side as one (d, K c) matrix, so the whole step is two matrix products.
    """
    k, d, c = w.shape
    n = x.shape[0]
    # (K c, n) layout: the softmax runs over a middle dimension, ~20x faster than over a last
    # dimension of size c on CPU.
    z = (w.transpose(1, 2).reshape(k * c, d) @ x.T).view(k, c, n)
    r = torch.softmax(z, dim=1) - y1.T.unsqueeze(0)  # (K, c, n)
    if x_norm is None:
        x_norm = (x * x).sum(1).sqrt()
    norms = (r * r).sum(1).sqrt() * x_norm.unsqueeze(0)  # (K, n); torch.norm is slow here
    r = r * clip_factors(norms, clip).unsqueeze(1)
    return (r.reshape(k * c, n) @ x).view(k, c, d).transpose(1, 2)


def train(
    data: Split,
    num_classes: int,
    runs: Sequence[Run],
    momentum: float,
    clip: float,
    secret: bool = False,
) -> torch.Tensor:
    """Train K zero-initialised heads in lockstep; head k stops after its own T_k steps.

    `secret` (privacy.randomness): the noise from the OS's cryptographic source, not the runs'
    seeds."""
    x, y = data.x, data.y
    n, d = x.shape
    k = len(runs)
    y1 = torch.nn.functional.one_hot(y, num_classes).float()
    x_norm = (x * x).sum(1).sqrt()
    w = torch.zeros(k, d, num_classes)
    v = torch.zeros_like(w)
    lr = torch.tensor([r.lr for r in runs]).view(k, 1, 1)
    sig = torch.tensor([r.sigma * clip for r in runs]).view(k, 1, 1)
    steps = torch.tensor([r.steps for r in runs])
    gens = [torch.Generator().manual_seed(10_000 + r.seed) for r in runs]
    for t in range(int(steps.max()) if k else 0):
        active = (steps > t).float().view(k, 1, 1)
        if secret:
            xi = randomness.os_normal_tensor((k, d, num_classes))
        else:
            xi = torch.stack([torch.randn(d, num_classes, generator=g) for g in gens])
        g = (clipped_grad_sum(x, y1, w, clip, x_norm) + sig * xi) / n
        v = active * (momentum * v + g) + (1 - active) * v
        w = w - active * lr * v
    return w


@torch.no_grad()
def correct(data: Split, w: torch.Tensor) -> list[int]:
    k, d, c = w.shape
    pred = (w.transpose(1, 2).reshape(k * c, d) @ data.x.T).view(k, c, -1).argmax(1)
    return [int(v) for v in (pred == data.y.unsqueeze(0)).sum(1)]
