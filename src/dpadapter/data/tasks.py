"""Carve the public set and the private tasks out of the source datasets, disjointly.

Allocation is deterministic (`data.split_seed`) and ordered: the public set first, then the
tasks in config order, each taking examples not yet taken. So the public set (and every
pre-trained checkpoint) depends only on the public config, and a task drawn from the same source
as the public set (Hypothesis 1 of the DPAdapter paper) is disjoint from it by construction.
Validation examples come from a task's training pool, or, for a source with a validation split
of its own (an image folder's val/ beside test/), from that split alone: every example of the
role's classes there, nothing carved from train, and none of them ever a training or test
example. Test examples come only from the source's test split. Normalisation statistics come
from the public training images alone (or are fixed public constants, `data.normalization`),
so no private statistic leaks into pre-processing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from dpadapter.data.registry import SPLITS, ArraySplit, load_dataset
from dpadapter.settings import Config, SplitConfig


class SplitError(ValueError):
    """A role asks for more examples than its source has left."""


@dataclass(frozen=True)
class Allocation:
    """Source indices of one role: which examples of the source's train/test pools it owns."""

    dataset: str
    classes: tuple[int, ...]
    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    train_split: str = "train"  # which source split `train` (and `val`, see below) index
    test_split: str = "test"  # which source split `test` indexes
    val_split: str | None = None  # which source split `val` indexes; None: train_split


@dataclass(frozen=True)
class RoleData:
    name: str
    num_classes: int
    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    allocation: Allocation

    def to(self, device: torch.device) -> RoleData:
        """The splits on `device` when they fit there (dpadapter.ground.device.place), else
        pinned."""
        from dpadapter.ground.device import place

        if device.type == "cpu":
            return self
        return dataclasses.replace(
            self,
            train=place(self.train, device),
            val=place(self.val, device),
            test=place(self.test, device),
        )


@dataclass(frozen=True)
class SplitPlan:
    allocations: dict[str, Allocation]  # "public" and every task name
    mean: torch.Tensor
    std: torch.Tensor
    in_chans: int
    image_size: int


def _take(pool_labels, free, classes, n, perm, what):
    """First `n` free examples of `classes` in the order of `perm`; marks them used."""
    wanted = torch.isin(pool_labels, torch.tensor(classes)) & free
    order = perm[wanted[perm]]
    if n is None:
        n = int(order.numel())
    if n > order.numel():
        raise SplitError(
            f"{what}: asks for {n} examples of classes {list(classes)}, only {order.numel()} left"
        )
    chosen = order[:n]
    free[chosen] = False
    return chosen


Pools = dict[str, tuple[ArraySplit, ...]]  # dataset -> (train, test) or (train, test, val)


def allocate(cfg: Config, pools: Pools) -> dict[str, Allocation]:
    roles: list[tuple[str, SplitConfig]] = [("public", cfg.public), *cfg.tasks.items()]
    free: dict[tuple[str, str], torch.Tensor] = {}
    perms: dict[tuple[str, str], torch.Tensor] = {}
    out = {}
    for name, sc in roles:
        by_split = dict(zip(SPLITS, pools[sc.dataset], strict=False))
        train_pool, test_pool = by_split[sc.train_split], by_split[sc.test_split]
        classes = sc.classes or tuple(sorted(set(by_split["train"].labels.tolist())))
        for which, pool in by_split.items():
            key = (sc.dataset, which)
            if key not in free:
                free[key] = torch.ones(len(pool), dtype=torch.bool)
                g = torch.Generator().manual_seed(
                    cfg.data.split_seed * 1_000_003 + SPLITS.index(which)
                )
                perms[key] = torch.randperm(len(pool), generator=g)
        tr_key, te_key = (sc.dataset, sc.train_split), (sc.dataset, sc.test_split)
        val_split = "val" if "val" in by_split else None
        if val_split is not None:
            # the source's own validation split: all of it for the role's classes (n_val is 0,
            # or that count: dpadapter.data.checks), nothing carved from the training pool
            v_key = (sc.dataset, val_split)
            val = _take(
                by_split[val_split].labels,
                free[v_key],
                classes,
                sc.n_val or None,
                perms[v_key],
                f"{name} (val)",
            )
            train = _take(
                train_pool.labels,
                free[tr_key],
                classes,
                sc.n_train,
                perms[tr_key],
                f"{name} (train)",
            )
        else:
            n_fit = None if sc.n_train is None else sc.n_train + sc.n_val
            fit = _take(
                train_pool.labels,
                free[tr_key],
                classes,
                n_fit,
                perms[tr_key],
                f"{name} (train+val)",
            )
            if sc.n_train is None and sc.n_val:
                if fit.numel() <= sc.n_val:
                    raise SplitError(f"{name}: n_val={sc.n_val} leaves no training examples")
            val, train = fit[: sc.n_val], fit[sc.n_val :]
        test = _take(
            test_pool.labels, free[te_key], classes, sc.n_test, perms[te_key], f"{name} (test)"
        )
        out[name] = Allocation(
            sc.dataset, tuple(classes), train, val, test, sc.train_split, sc.test_split, val_split
        )
    return out


def _to_float(
    images: torch.Tensor, image_size: int | None, channels: int | None = None
) -> torch.Tensor:
    x = images.float().div_(255.0)
    if image_size is not None and x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    if channels is not None and x.shape[1] != channels:
        if x.shape[1] == 3 and channels == 1:
            # A colour image as a grey one (a colour folder on the default's grey upstreams):
            # luminance with PIL's weights (mode L), a public transformation.
            w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
            return (x * w).sum(dim=1, keepdim=True)
        if x.shape[1] != 1:
            raise SplitError(f"cannot turn {x.shape[1]}-channel images into {channels} channels")
        # A grey image as an RGB one (Pretrain-DPFL feeds Fashion-MNIST to an ImageNet
        # backbone as 3x32x32): the same value in every channel, a public transformation.
        x = x.expand(-1, channels, -1, -1).contiguous()
    return x


def _relabel(labels: torch.Tensor, classes: tuple[int, ...]) -> torch.Tensor:
    top = max(classes) if labels.numel() == 0 else max(max(classes), int(labels.max()))
    lut = torch.full((top + 1,), -1, dtype=torch.long)
    lut[torch.tensor(classes)] = torch.arange(len(classes))
    return lut[labels]


def _split_pool(pools: Pools, dataset: str, split: str) -> ArraySplit:
    return pools[dataset][SPLITS.index(split)]


def load_pools(cfg: Config) -> Pools:
    names = {cfg.public.dataset, *(t.dataset for t in cfg.tasks.values())}
    return {n: load_dataset(n, cfg.data.root, cfg.data.download) for n in sorted(names)}


def build_splits(
    cfg: Config, roles: list[str] | None = None
) -> tuple[SplitPlan, dict[str, RoleData]]:
    """Allocate every role, then materialise normalised tensors for the requested ones."""
    pools = load_pools(cfg)
    allocs = allocate(cfg, pools)
    pub = allocs["public"]
    pub_train = _split_pool(pools, pub.dataset, pub.train_split).images[pub.train]
    image_size = cfg.data.image_size or int(pub_train.shape[-1])
    x_pub = _to_float(pub_train, image_size, cfg.public.channels)
    in_chans = int(x_pub.shape[1])
    if cfg.data.normalization is None:
        mean = x_pub.mean(dim=(0, 2, 3))
        std = x_pub.std(dim=(0, 2, 3)).clamp_min(1e-6)
    else:
        mean, std = (torch.tensor(v, dtype=x_pub.dtype) for v in cfg.data.normalization)
        if len(mean) != in_chans:
            raise SplitError(
                f"data.normalization has {len(mean)} channel(s), the images {in_chans}"
            )
    plan = SplitPlan(allocs, mean, std, in_chans, image_size)
    del x_pub

    out = {}
    for name in roles if roles is not None else list(allocs):
        if name not in allocs:
            raise KeyError(f"unknown role {name!r}; known: {sorted(allocs)}")
        a = allocs[name]
        train_pool = _split_pool(pools, a.dataset, a.train_split)
        val_pool = _split_pool(pools, a.dataset, a.val_split or a.train_split)
        test_pool = _split_pool(pools, a.dataset, a.test_split)
        parts = []
        channels = (cfg.public if name == "public" else cfg.tasks[name]).channels
        for pool, idx in ((train_pool, a.train), (val_pool, a.val), (test_pool, a.test)):
            x = _to_float(pool.images[idx], image_size, channels)
            if x.shape[1] != in_chans:
                raise SplitError(
                    f"{name}: images have {x.shape[1]} channels, the public set {in_chans}; "
                    f"choose datasets with matching channels or set tasks.{name}.channels"
                )
            x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
            parts.append(TensorDataset(x, _relabel(pool.labels[idx], a.classes)))
        out[name] = RoleData(name, len(a.classes), *parts, allocation=a)
    return plan, out


def public_train(cfg: Config) -> Callable[[], TensorDataset]:
    """The public training split, loaded when called: only algorithms with public data ask."""
    return lambda: build_splits(cfg, ["public"])[1]["public"].train
