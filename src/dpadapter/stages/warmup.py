"""Warm-up: standard training on the public set, the starting point of every trained upstream."""

from __future__ import annotations

from pathlib import Path

from dpadapter.data import build_splits
from dpadapter.ground import device as devices
from dpadapter.models import create_model
from dpadapter.settings import Config
from dpadapter.stages.pretrain import public_report
from dpadapter.train.checkpoint import save_model
from dpadapter.train.job import seed_everything, training_job
from dpadapter.train.loops import sgd_train
from dpadapter.train.resume import ResumeFile, resume_file_path


def run(cfg: Config, out_dir: Path) -> dict:
    seed_everything(cfg.seed)
    plan, roles = build_splits(cfg, ["public"])
    dev = devices.resolve(cfg.device)
    public = roles["public"].to(dev)
    # Kept outside the outputs, so a killed or timed-out job continues on its retry.
    resume = ResumeFile(
        resume_file_path(cfg.results_dir, "warmup"),
        identity=repr((cfg.warmup, cfg.model, cfg.public, cfg.data, cfg.seed)),
    )
    run_id = resume.state.get("mlflow_run_id") if resume.state else None
    with training_job(cfg, "warmup", {}, out_dir, resume_run_id=run_id) as (run_, metrics):
        resume.extra["mlflow_run_id"] = run_.run_id
        if resume.state:
            metrics["resumed_from"] = resume.position()
        run_.log_params(
            {
                "model": cfg.model.__dict__,
                "warmup": cfg.warmup.__dict__,
                "seed": cfg.seed,
                "public": cfg.public.__dict__,
            }
        )
        model = create_model(cfg.model, public.num_classes, plan.in_chans, cfg.seed).to(dev)

        def log_epoch(epoch: int, stats: dict) -> None:
            run_.log_metrics({k: v for k, v in stats.items() if k != "epoch"}, step=epoch)

        stats = sgd_train(
            model,
            public.train,
            cfg.warmup,
            seed=cfg.seed,
            on_epoch=log_epoch,
            desc="warmup",
            resume=resume,
            val=public.val,
        )
        metrics.update(public_report(cfg, model, public))
        metrics["train"] = stats
        metrics["hyperparameters"] = {
            "sgd": cfg.warmup.__dict__,
            "model": cfg.model.__dict__,
            "seed": cfg.seed,
        }
        run_.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float)})
        metrics["checkpoint"] = save_model(
            out_dir / "model.pt",
            model,
            cfg.model,
            public.num_classes,
            plan.in_chans,
            {"stage": "warmup"},
        )
    resume.clear()
    return metrics
