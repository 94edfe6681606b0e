"""Warm-up: standard training on the public set, the starting point of every trained upstream."""

from __future__ import annotations

from pathlib import Path

from dpadapter.config import Config
from dpadapter.data import build_splits
from dpadapter.models import create_model
from dpadapter.stages.job import seed_everything, training_job
from dpadapter.stages.pretrain import public_report
from dpadapter.train.checkpoint import save_model
from dpadapter.train.loops import sgd_train


def run(cfg: Config, out_dir: Path) -> dict:
    seed_everything(cfg.seed)
    plan, roles = build_splits(cfg, ["public"])
    public = roles["public"]
    with training_job(cfg, "warmup", {}, out_dir) as (run_, metrics):
        run_.log_params(
            {
                "model": cfg.model.__dict__,
                "warmup": cfg.warmup.__dict__,
                "seed": cfg.seed,
                "public": cfg.public.__dict__,
            }
        )
        model = create_model(cfg.model, public.num_classes, plan.in_chans, cfg.seed)

        def log_epoch(epoch: int, stats: dict) -> None:
            run_.log_metrics({k: v for k, v in stats.items() if k != "epoch"}, step=epoch)

        stats = sgd_train(
            model, public.train, cfg.warmup, seed=cfg.seed, on_epoch=log_epoch, desc="warmup"
        )
        metrics.update(public_report(cfg, model, public))
        metrics["train"] = stats
        metrics["hyperparameters"] = {
            "sgd": cfg.warmup.__dict__,
            "model": cfg.model.__dict__,
            "seed": cfg.seed,
        }
        run_.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float)})
        save_model(
            out_dir / "model.pt",
            model,
            cfg.model,
            public.num_classes,
            plan.in_chans,
            {"stage": "warmup"},
        )
    return metrics
