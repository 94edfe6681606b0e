"""What every training job shares: seeding, an MLflow run, and an atomic metrics.json."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dpadapter import tracking
from dpadapter.ground import atomic, distributed
from dpadapter.ground import device as devices
from dpadapter.settings import Config


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Atomically; in a job of several processes from rank 0 only (the others' are equal)."""
    if distributed.world().writer:
        atomic.write_text(
            path, json.dumps(payload, indent=2, sort_keys=False, default=float) + "\n"
        )


def process_resources() -> dict[str, float]:
    """The training process's own peak memory and CPU time, whatever launched it.

    Snakemake's benchmark files measure the command it started: for a job forked from the
    prefork server that is the waiting client (17 MB, 0.04 s CPU), useless for sizing Slurm's
    `mem_mb`. Read inside the process that trains (a forked child counts from its fork), these
    are what the job used; `device.peak_memory_mib` is its GPU peak."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "max_rss_mib": round(r.ru_maxrss / 1024, 1),  # KiB on Linux
        "cpu_user_s": round(r.ru_utime, 2),
        "cpu_system_s": round(r.ru_stime, 2),
    }


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


_KNOWN_AT_START = ("target_epsilon", "algorithm", "upstream", "task")


@contextlib.contextmanager
def training_job(
    cfg: Config,
    stage: str,
    wildcards: dict[str, str],
    out_dir: Path,
    resume_run_id: str | None = None,
    parent_run_id: str | None = None,
) -> Iterator[tuple[tracking.Run, dict]]:
    """Yield (mlflow run, metrics dict); on success write metrics.json and attach it to the run.

    The run is nested under `parent_run_id` (an HPO plan's run), else under its stage's group
    run of this config (tracking.job)."""
    torch.set_num_threads(int(os.environ.get("DPADAPTER_THREADS", torch.get_num_threads())))
    # In a job of several processes only rank 0 writes metrics.json and the MLflow run; the
    # other ranks train their shard and keep their metrics to themselves.
    writer = distributed.world().writer
    if not writer:
        cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, enabled=False))
    out_dir.mkdir(parents=True, exist_ok=True)
    job = tracking.job(cfg, stage, wildcards)
    # Where the job runs, decided once (config `device`, or $DPADAPTER_DEVICE for this job);
    # a job asked for CUDA on a node without it fails here, before any work.
    dev = devices.resolve(cfg.device)
    devices.configure(dev, cfg.tf32)
    metrics: dict[str, Any] = {
        "stage": stage,
        "wildcards": wildcards,
        "device": devices.describe(dev),
        # processes of the job (finetune.processes: torchrun, dpadapter.ground.distributed)
        "processes": distributed.world().size,
        # seeded (reproducible) or secret (the OS's source) noise and sampling; docs/privacy.md
        "randomness": cfg.privacy.randomness_record(),
    }
    devices.reset_peak_memory(dev)
    t0 = time.time()
    with tracking.start_run(
        cfg.tracking,
        run_name=job.name,
        tags=job.tags,
        run_id=resume_run_id,
        results_dir=cfg.results_dir,
        parent=parent_run_id or (job.group, job.group_name),
        on_cuda=dev.type == "cuda",
    ) as run:
        run.set_tags({f"device.{k}": v for k, v in metrics["device"].items()})
        # What the wildcards fix before training (a killed run shows it too); the rest after.
        # Not the seed: an HPO trial's own seed differs from its wildcard's.
        known = tracking.dp_summary({"wildcards": wildcards})[0]
        run.log_new({k: v for k, v in known.items() if k in _KNOWN_AT_START}, {})
        yield run, metrics
        metrics["wall_time_s"] = round(time.time() - t0, 2)
        metrics["device"]["peak_memory_mib"] = devices.peak_memory_mib(dev)
        metrics["resources"] = process_resources()
        metrics["host"] = platform.node()
        if not writer:
            return
        path = out_dir / "metrics.json"
        write_json(path, metrics)
        run.log_metrics({"wall_time_s": metrics["wall_time_s"], **metrics["resources"]})
        if metrics["device"]["peak_memory_mib"] is not None:
            run.log_metrics({"peak_gpu_memory_mib": metrics["device"]["peak_memory_mib"]})
        run.log_new(*tracking.dp_summary(metrics))
        run.log_artifact(path)
