"""Checkpoints the external-weights tests make: tiny timm models saved as a foreign lab would."""

from __future__ import annotations

from pathlib import Path

import torch

from dpadapter.data import build_splits
from dpadapter.models import create_model
from dpadapter.settings import ModelConfig
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


# Tiny stand-ins for DP-SAT Table 3's backbones (configs/dpsat-table3.yaml): the same timm
# families at a few thousand weights, RGB 32x32. timm's crossvit_18_240 sets its architecture
# arguments itself and cannot be shrunk (refused by name: models.factory.with_timm_args), so its
# label gets crossvit_9_240 at this size.
_CROSSVIT = {
    "img_size": 32,
    "img_scale": [1.0, 1.0],
    "patch_size": [8, 16],
    "embed_dim": [16, 32],
    "depth": [[1, 1, 0]],
    "num_heads": [1, 1],
    "mlp_ratio": [2, 2, 1],
}
_VIT = {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2}
TABLE3 = {
    "crossvit-18": ("timm:crossvit_9_240", _CROSSVIT),
    "vit-s": ("timm:vit_small_patch16_224", _VIT),
    "deit-b": ("timm:deit_base_patch16_224", _VIT),
    "crossvit-tiny": ("timm:crossvit_tiny_240", _CROSSVIT),
    "crossvit-small": ("timm:crossvit_small_240", _CROSSVIT),
}


def save_table3_checkpoints(folder: Path) -> dict[str, dict]:
    """One weights file per label of DP-SAT Table 3; `pretrain.external` params for each."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for seed, (label, (name, args)) in enumerate(TABLE3.items()):
        model = create_model(ModelConfig(name), 1000, 3, seed, timm_args=args).eval()
        path = save_as(model, folder / f"{label}.pth", "state_dict")
        out[label] = {"model": name, "weights": {"file": str(path)}, "timm_args": args}
    return out


def write_image_folder(base: Path, classes: int, train: int, test: int, side: int = 32) -> None:
    """An ImageFolder tree (`imagefolder:` datasets): a colour and a noise level per class; no
    test/ class folder where `test` is 0 (an empty class folder is refused)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(classes)
    for c in range(classes):
        colour = rng.integers(0, 256, 3)
        for split, n in (("train", train), ("test", test)):
            d = base / split / f"c{c:03d}"
            if n:
                d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                noise = rng.integers(-40, 40, (side, side, 3))
                pixels = np.clip(colour + noise, 0, 255).astype("uint8")
                Image.fromarray(pixels, "RGB").save(d / f"{i}.png")
