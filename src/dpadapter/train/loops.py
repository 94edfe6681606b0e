"""Evaluation and the non-private SGD loop shared by warm-up and every upstream method."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from dpadapter.ground import device as devices
from dpadapter.ground import distributed
from dpadapter.ground.device import to
from dpadapter.settings import SGDConfig
from dpadapter.train.batching import ShuffledBatches
from dpadapter.train.progress import ProgressLine
from dpadapter.train.resume import ResumeFile

StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], float]

# Within a long epoch, `sgd_train` saves its resume state at most this often (seconds).
SAVE_EVERY_S = 300.0


def progress(iterable, **kw):
    """tqdm that stays quiet in logs that are not terminals (Snakemake job logs)."""
    return tqdm(iterable, disable=not sys.stderr.isatty(), leave=False, **kw)


# Evaluation batches: on a CPU activations of 1,000 images spill out of the caches, and 256 runs
# the embedded default's evaluations 20 % faster (quiet 2-core machine, docs/measured.md) with
# the same logits bit for bit (GroupNorm and eval-mode BatchNorm see each example alone); a GPU
# wants the large batch.
EVAL_BATCH = {"cpu": 256}
EVAL_BATCH_OTHER = 1000


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, batch_size: int | None = None) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    x_all, y_all = data.tensors
    dev = model_device(model)
    if batch_size is None:
        batch_size = EVAL_BATCH.get(dev.type, EVAL_BATCH_OTHER)
    hits = torch.zeros((), dtype=torch.long, device=dev)
    for i in range(0, len(y_all), batch_size):
        x, y = to(x_all[i : i + batch_size], dev), to(y_all[i : i + batch_size], dev)
        hits += (model(x).argmax(1) == y).sum()
    correct = int(hits)  # one device sync per evaluation, not per batch
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


def model_device(model: nn.Module) -> torch.device:
    """Where the model lives: batches are moved there (a model without parameters: CPU)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def mean_loss_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`cross_entropy(model(x), y).backward()`; returns the (detached) mean loss.

    In a job of several processes (`pretrain.processes`, torchrun) every rank holds the same
    batch and model; each takes its rows r, r + k, ... of the batch, back-propagates its part of
    the batch's mean (sum over its rows / the batch size) and the gradients are summed over the
    ranks in one all-reduce: every rank gets the whole batch's mean gradient (up to the order of
    the sums) and makes the same update, so the replicas stay equal. One process: unchanged.
    """
    w = distributed.world()
    if not w.multi:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()
    params = [p for p in model.parameters() if p.requires_grad]
    xs, ys = x[w.rank :: w.size], y[w.rank :: w.size]
    if len(ys):
        loss = nn.functional.cross_entropy(model(xs), ys, reduction="sum") / len(y)
        loss.backward()
        local = loss.detach().reshape(1).clone()
    else:  # fewer rows than ranks: this rank adds nothing
        local = torch.zeros(1, device=params[0].device, dtype=params[0].dtype)
    for p in params:  # the same tensors on every rank for the one all-reduce
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    distributed.all_reduce_sum([p.grad for p in params])
    distributed.all_reduce_sum([local])
    return local.reshape(())


def standard_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = mean_loss_backward(model, x, y)
    opt.step()
    return float(loss)


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
    resume: ResumeFile | None = None,
    val: TensorDataset | None = None,
    save_every_s: float = SAVE_EVERY_S,
) -> dict:
    """Shuffled mini-batch SGD with momentum, weight decay and a step LR schedule.

    With `resume`, the loop's whole position is saved at the end of every epoch and, within an
    epoch, at most every `save_every_s` seconds (0: after every step): model, optimizer,
    scheduler, the shuffling generator as it was when the epoch began (the resumed epoch replays
    its permutation and skips the batches already taken), the global RNG and the step
    function's own state (`state_dict`/`load_state_dict`, e.g. DPAdapter's B1 sampler and its
    reused Delta). A run restored from it takes exactly the steps of an uninterrupted one.
    `val` (optional) adds `val_accuracy` to each epoch's stats. Every epoch prints a progress
    line on stderr (`dpadapter.train.progress`).
    """
    g = torch.Generator().manual_seed(seed)
    dev = model_device(model)
    if dev.type == "cpu" and data.tensors[0].device.type == "cpu":
        # The CPU path keeps the DataLoader it always had: runs reproduce bit for bit.
        loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=g)
    else:
        loader = ShuffledBatches(data, cfg.batch_size, g, dev)
    per_step = cfg.schedule_unit == "steps"
    if per_step:
        if cfg.max_steps is None:
            raise ValueError("schedule_unit 'steps' needs max_steps (the number of updates K)")
        # as many passes as K updates need; the last one stops at K
        cfg = dataclasses.replace(cfg, epochs=math.ceil(cfg.max_steps / max(1, len(loader))))
    opt, sched = make_sgd(model, cfg)
    model.train()
    steps, first_epoch, skip, total, n = 0, 0, 0, 0.0, 0
    stats: dict = {}
    state = resume.state if resume is not None else None
    first = next(model.parameters())
    dev = first.device
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        if state.get("step") is not None:
            step.load_state_dict(  # type: ignore[attr-defined]
                state["step"], device=dev, dtype=first.dtype
            )
        g.set_state(state["loader_rng"])
        devices.set_rng_state(state["rng"])
        first_epoch, skip, steps = state["epoch"], state["batch"], state["steps"]
        total, n = state["partial"]
        stats = dict(state.get("stats", {}))
    planned = cfg.epochs * len(loader)
    report = ProgressLine(
        desc, planned if cfg.max_steps is None else min(planned, cfg.max_steps), start_step=steps
    )
    last_save = time.monotonic()

    def save(epoch: int, batch: int, loader_rng: torch.Tensor) -> None:
        assert resume is not None
        if not distributed.world().writer:
            return  # the ranks' states are equal (same seeds, same updates): rank 0 saves
        resume.save(
            {
                "epoch": epoch,
                "batch": batch,
                "steps": steps,
                "partial": (total, n),
                "stats": stats,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "step": step.state_dict() if hasattr(step, "state_dict") else None,
                "loader_rng": loader_rng,
                "rng": devices.rng_state(dev),
            }
        )

    for epoch in range(first_epoch, cfg.epochs):
        epoch_rng = g.get_state()  # the epoch's permutation is drawn from this state
        if skip == 0:
            total, n = 0.0, 0
        batches = progress(loader, desc=f"{desc} epoch {epoch + 1}/{cfg.epochs}")
        for i, (x, y) in enumerate(batches):
            if i < skip:
                continue  # taken before the interruption
            loss = step(model, opt, x, y)
            total += loss * len(y)
            n += len(y)
            steps += 1
            if per_step:
                sched.step()
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                break
            if resume is not None and time.monotonic() - last_save >= save_every_s:
                save(epoch, i + 1, epoch_rng)
                last_save = time.monotonic()
            report.step(steps, loss)
        skip = 0
        if not per_step:
            sched.step()
        stats = {"epoch": epoch + 1, "train_loss": total / max(1, n), "steps": steps}
        if val is not None and len(val):
            stats["val_accuracy"] = evaluate(model, val)
        if on_epoch is not None:
            on_epoch(epoch + 1, stats)
        report.epoch(epoch + 1, cfg.epochs, stats)
        if cfg.max_steps is not None and steps >= cfg.max_steps:
            break
        if resume is not None and epoch + 1 < cfg.epochs:
            save(epoch + 1, 0, g.get_state())
            last_save = time.monotonic()
    return stats
