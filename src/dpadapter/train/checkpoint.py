"""Model checkpoints that carry what is needed to rebuild the model without the config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpadapter.config import ModelConfig
from dpadapter.models import create_model


def save_model(
    path: str | Path,
    model: nn.Module,
    model_cfg: ModelConfig,
    num_classes: int,
    in_chans: int,
    meta: dict[str, Any],
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(
        {
            "model": {"name": model_cfg.name, "groups": model_cfg.groups, "width": model_cfg.width},
            "num_classes": num_classes,
            "in_chans": in_chans,
            "state_dict": model.state_dict(),
            "meta": meta,
        },
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written checkpoint under the final name


def load_model(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = create_model(
        ModelConfig(**ckpt["model"]), ckpt["num_classes"], ckpt["in_chans"], seed=0
    )
    model.load_state_dict(ckpt["state_dict"])
    return model, ckpt
