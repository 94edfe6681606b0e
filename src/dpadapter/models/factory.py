"""One way to build every backbone, and one way to swap its head for a task."""

from __future__ import annotations

import re

import torch
from torch import nn

from dpadapter.models.batchnorm import apply_batchnorm_choice
from dpadapter.models.dpnas import DPNASMNIST
from dpadapter.models.nets import ResNet20GN, SmallCNN
from dpadapter.models.pretrain_dpfl import PretrainDPFLCNN
from dpadapter.models.resnet10 import GNResNet10
from dpadapter.settings import ModelConfig

MODEL_NAMES = {
    "resnet20-gn": ResNet20GN,
    "cnn-gn": SmallCNN,
    "gnresnet10": GNResNet10,
    "dpnas-mnist": DPNASMNIST,
    "dpfl-cnn": PretrainDPFLCNN,
}


def create_model(
    cfg: ModelConfig,
    num_classes: int,
    in_chans: int,
    seed: int,
    timm_args: dict | None = None,
) -> nn.Module:
    """Build with an explicit seed; a timm backbone's BatchNorms follow `model.batchnorm`.

    Never loads weights (pretrained=False): upstream weights come from this pipeline or, for
    the `external` upstream method, from a file it loads itself (dpadapter.upstream.external).
    `timm_args` go to `timm.create_model` (e.g. a ViT's img_size); pipeline models take none.
    """
    torch.manual_seed(seed)
    if cfg.name.startswith("timm:"):
        import timm

        def build(args: dict) -> nn.Module:
            return timm.create_model(
                cfg.name[5:], pretrained=False, num_classes=num_classes, in_chans=in_chans, **args
            )

        model = with_timm_args(cfg.name[5:], build, dict(timm_args or {}))
        return apply_batchnorm_choice(model, cfg.batchnorm)
    if timm_args:
        raise ValueError(f"model {cfg.name!r} takes no timm arguments, got {sorted(timm_args)}")
    try:
        cls = MODEL_NAMES[cfg.name]
    except KeyError:
        raise KeyError(
            f"unknown model {cfg.name!r}; known: {sorted(MODEL_NAMES)} or timm:<name>"
        ) from None
    return cls(num_classes=num_classes, in_chans=in_chans, groups=cfg.groups, width=cfg.width)


_FIXED = re.compile(r"got multiple values for keyword argument '(\w+)'")


def with_timm_args(name: str, build, timm_args: dict):
    """`build(timm_args)`, or a ValueError naming every argument the model cannot take.

    Some timm entry points set architecture arguments themselves and pass the caller's as well
    (`crossvit_18_240` writes `dict(img_scale=..., ..., **kwargs)`), so any of those in
    `timm_args` fails with Python's `got multiple values for keyword argument`, one name at a
    time. The call fails before the model is built, so trying again without each named argument
    is cheap and lists them all, which is the message a user needs (the config key to edit and
    every argument to leave out of it)."""
    fixed: list[str] = []
    args = dict(timm_args)
    while True:
        try:
            model = build(args)
        except TypeError as exc:
            clash = _FIXED.search(str(exc))
            if clash is None or clash[1] not in args:
                raise
            fixed.append(clash[1])
            del args[clash[1]]
            continue
        if not fixed:
            return model
        rest = f" ({', '.join(sorted(args))} can stay)" if args else ""
        raise ValueError(
            f"timm's {name} sets {', '.join(fixed)} itself and cannot take "
            f"{'it' if len(fixed) == 1 else 'them'} as timm_args (its entry point would pass "
            f"both values): leave {'it' if len(fixed) == 1 else 'them'} out{rest}, or pick a "
            "timm model whose entry point takes them (e.g. crossvit_9_240 for a CrossViT)"
        )


def replace_head(model: nn.Module, num_classes: int, seed: int) -> nn.Module:
    """Fresh, seeded classifier for a task's classes (timm's reset_classifier interface)."""
    torch.manual_seed(seed)
    model.reset_classifier(num_classes)
    return model


def get_head_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.get_classifier().parameters())
