"""Checkpoints the external-weights tests make: tiny timm models saved as a foreign lab would."""

from __future__ import annotations

from pathlib import Path

import torch

from dpadapter.config import ModelConfig
from dpadapter.data import build_splits
from dpadapter.models import create_model
from dpadapter.upstream import UpstreamContext
from dpadapter.upstream.external import External

VIT = (
    "timm:vit_tiny_patch16_224",
    {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2},
)
RESNET = ("timm:resnet18", {"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64], "stem_width": 8})
BACKBONES = {"vit": VIT, "resnet": RESNET}


def source_model(which: str, seed: int = 7, n_classes: int = 1000) -> torch.nn.Module:
    """A "foreign" checkpoint: its own seed, its own 1000-class head, BatchNorm statistics."""
    name, args = BACKBONES[which]
    m = create_model(ModelConfig(name, batchnorm="freeze"), n_classes, 3, seed, timm_args=args)
    m.train()
    with torch.no_grad():  # moves BatchNorm's running statistics away from (0, 1)
        for _ in range(2):
            m(torch.rand(8, 3, 32, 32) * 2)
    return m.eval()


def save_as(model: torch.nn.Module, path: Path, form: str) -> Path:
    state = model.state_dict()
    if form == "state_dict":
        torch.save(state, path)
    elif form == "timm_checkpoint":  # what timm's train.py writes
        torch.save({"epoch": 3, "arch": "x", "state_dict": state, "optimizer": {}}, path)
    elif form == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def params_for(which: str, path: Path, **extra) -> dict:
    """The ViT's side comes from its img_size; the ResNet's pretrained_cfg says 224: ask 32."""
    name, args = BACKBONES[which]
    size = {"input": {"size": 32}} if which == "resnet" else {}
    return {"model": name, "weights": {"file": str(path)}, "timm_args": args, **size, **extra}


def build(tiny_cfg, params: dict):
    plan, _ = build_splits(tiny_cfg, ["public"])
    method = External(params)
    ctx = UpstreamContext(tiny_cfg, plan, None, None, tiny_cfg.seed, lambda e, s: None)
    return method, method.build(ctx), ctx
