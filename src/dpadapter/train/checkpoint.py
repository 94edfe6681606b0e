"""Model checkpoints that carry what is needed to rebuild the model without the config.

Every checkpoint's sha256 is returned by `save_model` and stored by the stage in the
`checkpoint` block of the job's metrics.json, beside the file; `load_model` checks it, so a
truncated or corrupted file (a full disk, a copy cut short, bit rot on shared storage) fails
with the file's name and the command that rebuilds it instead of a raw torch/OS error that every
re-run repeats (Snakemake sees an up-to-date file and never rebuilds it by itself).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpadapter.ground import atomic, distributed
from dpadapter.models import create_model
from dpadapter.models.input_adapter import AdapterSpec, adapt
from dpadapter.settings import ModelConfig


def model_record(model_cfg: ModelConfig | dict[str, Any]) -> dict[str, Any]:
    """How to rebuild the backbone: `model_cfg`'s fields, or a record taken from a checkpoint.

    A checkpoint carries the model it was built with, not the config's `model` (an `external`
    upstream brings its own backbone), so a job that saves a model it loaded passes the loaded
    record on. A pipeline model's record is as it always was (same checkpoint bytes); a timm
    model's also names its BatchNorm choice. An external backbone adds `timm_args` and `input`
    (the `InputAdapter`'s spec).
    """
    if isinstance(model_cfg, dict):
        return dict(model_cfg)
    rec: dict[str, Any] = {
        "name": model_cfg.name,
        "groups": model_cfg.groups,
        "width": model_cfg.width,
    }
    if model_cfg.name.startswith("timm:"):
        rec["batchnorm"] = model_cfg.batchnorm
    return rec


def build_from_record(record: dict[str, Any], num_classes: int, in_chans: int) -> nn.Module:
    """The model a checkpoint's `model` record describes, freshly initialised (seed 0)."""
    rec = dict(record)
    timm_args = rec.pop("timm_args", None)
    spec = rec.pop("input", None)
    # Before `model.batchnorm` existed every timm model was built with GroupNorm.
    rec.setdefault("batchnorm", "groupnorm")
    backbone = create_model(ModelConfig(**rec), num_classes, in_chans, seed=0, timm_args=timm_args)
    return adapt(backbone, AdapterSpec.from_dict(spec) if spec else None)


def save_model(
    path: str | Path,
    model: nn.Module,
    model_cfg: ModelConfig | dict[str, Any],
    num_classes: int,
    in_chans: int,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Write the checkpoint atomically; return its `checkpoint` record for metrics.json.

    The hash is taken of the very bytes written (serialised in memory first), so the record
    describes this file and nothing else. `model_cfg` is the config's model or the `model`
    record of the checkpoint the model was loaded from (`model_record`); `in_chans` is what
    the backbone is built with.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(
        {
            "model": model_record(model_cfg),
            "num_classes": num_classes,
            "in_chans": in_chans,
            "state_dict": {
                k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                for k, v in model.state_dict().items()
            },
            "meta": meta,
        },
        buf,
    )
    data = buf.getvalue()
    # never a half-written checkpoint under the final name, nor one of two concurrent writers';
    # in a job of several processes the replicas are equal and rank 0 alone writes
    if distributed.world().writer:
        atomic.write_bytes(path, data, fsync=True)
    return {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be trusted or read; the message says how to rebuild."""


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _metrics_beside(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path.parent / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def rebuild_hint(path: str | Path, metrics: dict[str, Any] | None = None) -> str:
    """The command that rebuilds `path`: force the one job that writes it, then the rest."""
    path = Path(path)
    rule = (metrics or {}).get("stage")
    by = f" (rule `{rule}`)" if rule else ""
    return (
        f"Rebuild it{by} with `snakemake --cores all --force {path}` (add the --configfile / "
        f"--config options of the run that made it), then run `snakemake` again to redo the "
        f"jobs that depend on it; or delete {path} and run `snakemake`."
    )


def verify_checkpoint(path: str | Path) -> None:
    """Compare the file with the sha256 recorded in metrics.json beside it, when there is one.

    A checkpoint without a record (written before records existed, or outside a stage) is only
    checked by loading it.
    """
    path = Path(path)
    metrics = _metrics_beside(path)
    record = (metrics or {}).get("checkpoint")
    if not isinstance(record, dict) or record.get("file") != path.name:
        return
    actual = file_sha256(path)
    if actual != record.get("sha256"):
        size = path.stat().st_size
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated: {size} bytes with sha256 "
            f"{actual[:16]}..., but {path.parent / 'metrics.json'} records "
            f"{record.get('bytes')} bytes with sha256 {str(record.get('sha256'))[:16]}... "
            f"as written. {rebuild_hint(path, metrics)}"
        )


def load_model(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    verify_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = build_from_record(ckpt["model"], ckpt["num_classes"], ckpt["in_chans"])
        model.load_state_dict(ckpt["state_dict"])
    except Exception as exc:  # any unreadable file: truncated zip, foreign pickle, wrong keys
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it is corrupt, truncated or not "
            f"a dpadapter model checkpoint. {rebuild_hint(path, _metrics_beside(path))}"
        ) from exc
    return model, ckpt
