"""What every training job shares: seeding, an MLflow run, and an atomic metrics.json."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dpadapter import tracking
from dpadapter.config import Config


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=float) + "\n")
    os.replace(tmp, path)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


@contextlib.contextmanager
def training_job(
    cfg: Config,
    stage: str,
    wildcards: dict[str, str],
    out_dir: Path,
    resume_run_id: str | None = None,
) -> Iterator[tuple[tracking.Run, dict]]:
    """Yield (mlflow run, metrics dict); on success write metrics.json and attach it to the run."""
    torch.set_num_threads(int(os.environ.get("DPADAPTER_THREADS", torch.get_num_threads())))
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "/".join([stage, *wildcards.values()])
    tags = {"rule": stage, **{f"wildcard.{k}": str(v) for k, v in wildcards.items()}}
    metrics: dict[str, Any] = {"stage": stage, "wildcards": wildcards}
    t0 = time.time()
    with tracking.start_run(cfg.tracking, run_name=name, tags=tags, run_id=resume_run_id) as run:
        yield run, metrics
        metrics["wall_time_s"] = round(time.time() - t0, 2)
        metrics["host"] = platform.node()
        path = out_dir / "metrics.json"
        write_json(path, metrics)
        run.log_metrics({"wall_time_s": metrics["wall_time_s"]})
        run.log_artifact(path)
