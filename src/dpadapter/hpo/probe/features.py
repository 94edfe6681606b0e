"""Frozen features of a pre-trained checkpoint, computed once per (upstream, task).

The linear-probe regime (Panda et al. 2024, Sec. 4.2 step 2) trains only a linear classifier on
the features of a frozen pre-trained model, so the backbone's forward pass is the same for every
trial, sweep, grid point and seed: computing it once (rule `hpo_features`) turns hundreds of
runs into small matrix products. The features are the input of the checkpoint's classifier
(captured with a forward hook, so any backbone with timm's `get_classifier` works).

Each feature vector is scaled to unit l2 norm. This is a per-example map that uses no statistic
of any dataset (no privacy cost), and it makes the per-example gradient norm of the linear head
at most sqrt(2) whatever the backbone's feature scale, so unit clipping (the paper's C = 1)
clips about as much for every checkpoint and the r grid means the same thing across upstreams.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dpadapter.ground import atomic
from dpadapter.per_sample.independence import make_independent

SPLITS = ("train", "val", "test")


@torch.no_grad()
def extract(model: nn.Module, x: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
    """Inputs of `model`'s classifier for every row of x, unit l2 norm, float32.

    The rows go through in batches: a module that mixes the examples of a batch even in eval
    mode would make each feature (so each clipped head gradient) depend on other examples, so
    the model is checked first (`make_independent` in eval mode) and refused if one does.
    """
    make_independent(model, x.shape[1:], x.dtype, train=False)
    captured: list[torch.Tensor] = []
    hook = model.get_classifier().register_forward_hook(
        lambda _m, inputs, _out: captured.append(torch.flatten(inputs[0], 1).detach())
    )
    was = model.training
    model.eval()
    try:
        for i in range(0, len(x), batch_size):
            model(x[i : i + batch_size])
    finally:
        hook.remove()
        model.train(was)
    f = torch.cat(captured) if captured else torch.zeros(0, 0)
    return (f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)).float()


def compute(cfg, task: str, ckpt: Path, out: Path) -> dict:
    """Features and labels of the task's train / val / test splits, saved to `out` (torch)."""
    from dpadapter.data import build_splits
    from dpadapter.train.checkpoint import load_model

    _, roles = build_splits(cfg, [task])
    d = roles[task]
    if len(d.val) == 0:
        raise ValueError(f"hpo needs a validation split to score trials: set tasks.{task}.n_val")
    model, _ = load_model(ckpt)
    payload: dict = {"task": task, "checkpoint": str(ckpt), "num_classes": d.num_classes}
    for name in SPLITS:
        x, y = getattr(d, name).tensors
        payload[name] = {"x": extract(model, x), "y": y.clone()}
    atomic.torch_save(payload, out)
    return payload


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class Split:
    x: torch.Tensor  # (n, d) features
    y: torch.Tensor  # (n,) labels


@dataclass(frozen=True)
class ProbeData:
    num_classes: int
    train: Split
    val: Split
    test: Split | None  # None where selection runs: the test split is never handed to it


def load_data(path: Path, with_test: bool) -> ProbeData:
    p = load(path)

    def split(name: str) -> Split:
        return Split(p[name]["x"].float(), p[name]["y"].long())

    return ProbeData(
        int(p["num_classes"]), split("train"), split("val"), split("test") if with_test else None
    )
