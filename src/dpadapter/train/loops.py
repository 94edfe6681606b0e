"""Evaluation and the non-private SGD loop shared by warm-up and every upstream method."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from dpadapter.config import SGDConfig

StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], float]


def progress(iterable, **kw):
    """tqdm that stays quiet in logs that are not terminals (Snakemake job logs)."""
    return tqdm(iterable, disable=not sys.stderr.isatty(), leave=False, **kw)


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, batch_size: int = 1000) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    x_all, y_all = data.tensors
    for i in range(0, len(y_all), batch_size):
        correct += (
            (model(x_all[i : i + batch_size]).argmax(1) == y_all[i : i + batch_size]).sum().item()
        )
    model.train(was_training)
    return correct / max(1, len(y_all))


@torch.no_grad()
def robust_accuracy(
    model: nn.Module, data: TensorDataset, noise_std: float, draws: int, seed: int
) -> float:
    """Accuracy after i.i.d. N(0, noise_std^2) on every parameter, averaged over seeded draws.

    The DPAdapter paper's measure of parameter robustness (Section 2.3). Weights are restored
    exactly after each draw.
    """
    if noise_std == 0:
        return evaluate(model, data)
    params = [p for p in model.parameters()]
    saved = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(seed)
    accs = []
    try:
        for _ in range(draws):
            for p in params:
                p.add_(torch.randn(p.shape, generator=g).to(p) * noise_std)
            accs.append(evaluate(model, data))
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    finally:
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return sum(accs) / len(accs)


def standard_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def make_sgd(model: nn.Module, cfg: SGDConfig):
    opt = torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.MultiStepLR(
        opt, milestones=list(cfg.milestones), gamma=cfg.lr_gamma
    )
    return opt, sched


def sgd_train(
    model: nn.Module,
    data: TensorDataset,
    cfg: SGDConfig,
    seed: int,
    step: StepFn = standard_step,
    on_epoch: Callable[[int, dict], None] | None = None,
    desc: str = "train",
) -> dict:
    """Shuffled mini-batch SGD with momentum, weight decay and a step LR schedule."""
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=g, drop_last=False)
    opt, sched = make_sgd(model, cfg)
    model.train()
    steps = 0
    stats: dict = {}
    for epoch in range(cfg.epochs):
        total, n = 0.0, 0
        for x, y in progress(loader, desc=f"{desc} epoch {epoch + 1}/{cfg.epochs}"):
            total += step(model, opt, x, y) * len(y)
            n += len(y)
            steps += 1
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                break
        sched.step()
        stats = {"epoch": epoch + 1, "train_loss": total / max(1, n), "steps": steps}
        if on_epoch is not None:
            on_epoch(epoch + 1, stats)
        if cfg.max_steps is not None and steps >= cfg.max_steps:
            break
    return stats
