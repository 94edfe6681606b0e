"""Pre-training: run one registered upstream method and report its public (robust) accuracy."""

from __future__ import annotations

from pathlib import Path

from dpadapter.data import build_splits
from dpadapter.data.tasks import RoleData
from dpadapter.ground import device as devices
from dpadapter.settings import Config
from dpadapter.train.checkpoint import file_sha256, load_model, save_model
from dpadapter.train.job import seed_everything, training_job
from dpadapter.train.loops import evaluate, robust_accuracy
from dpadapter.train.resume import ResumeFile, resume_file_path
from dpadapter.upstream import UpstreamContext
from dpadapter.upstream.resolve import method_for


def public_report(cfg: Config, model, public: RoleData) -> dict:
    """Accuracy and robust accuracy on the public test split (public data: no privacy cost)."""
    r = cfg.robustness
    return {
        "public_test_accuracy": evaluate(model, public.test),
        "public_test_robust_accuracy": robust_accuracy(
            model, public.test, r.noise_std, r.draws, r.seed
        ),
        "robustness": {"noise_std": r.noise_std, "draws": r.draws, "seed": r.seed},
    }


def run(cfg: Config, method_name: str, out_dir: Path, warmup_ckpt: Path | None) -> dict:
    method = method_for(cfg, method_name)
    base = method.name
    seed_everything(cfg.seed)
    plan, roles = build_splits(cfg, ["public"])
    dev = devices.resolve(cfg.device)
    public = roles["public"].to(dev)
    # Kept outside the outputs, so a killed or timed-out job continues on its retry; the
    # identity includes the warm-up checkpoint's content, so a rebuilt warm-up starts afresh.
    resume = ResumeFile(
        resume_file_path(cfg.results_dir, "pretrain", method_name),
        identity=repr(
            (
                method_name,
                method.params,
                cfg.upstream_params,
                cfg.model,
                cfg.public,
                cfg.data,
                cfg.seed,
                file_sha256(warmup_ckpt) if warmup_ckpt and Path(warmup_ckpt).is_file() else None,
            )
        ),
    )
    run_id = resume.state.get("mlflow_run_id") if resume.state else None
    wildcards = {"upstream": method_name}
    with training_job(cfg, "pretrain", wildcards, out_dir, resume_run_id=run_id) as (
        run_,
        metrics,
    ):
        resume.extra["mlflow_run_id"] = run_.run_id
        if resume.state:
            metrics["resumed_from"] = resume.position()
        run_.log_params(
            {
                "upstream": method_name,
                "params": method.params,
                "model": cfg.model.__dict__,
                "seed": cfg.seed,
            }
        )
        warm = None
        if method.needs_warmup:
            if warmup_ckpt is None:
                raise ValueError(f"{method_name} needs the warm-up checkpoint")
            warm, _ = load_model(warmup_ckpt)
            warm.to(dev)

        def log_epoch(epoch: int, stats: dict) -> None:
            run_.log_metrics(
                {k: v for k, v in stats.items() if isinstance(v, int | float)}, step=epoch
            )

        ctx = UpstreamContext(
            cfg,
            plan,
            public if method.needs_public_data else None,
            warm,
            cfg.seed,
            log_epoch,
            resume=resume,
        )
        model = method.build(ctx).to(dev)  # scratch is built on the CPU
        if method.public_report:
            metrics.update(public_report(cfg, model, public))
        else:
            metrics["public_report"] = (
                f"skipped: {base} weights come with a head trained on other classes than the "
                "public set's, so its public test accuracy measures nothing"
            )
        source = method.provenance()
        if source is not None:
            metrics["weights"] = source
            run_.log_params(
                {"weights_source": source["source"], "weights_sha256": source["sha256"]}
            )
        metrics["hyperparameters"] = {"upstream": base, **method.params, "seed": cfg.seed}
        run_.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float)})
        record, in_chans = method.checkpoint_model(ctx)
        metrics["checkpoint"] = save_model(
            out_dir / "model.pt",
            model,
            record,
            public.num_classes,
            in_chans,
            {"upstream": method_name},
        )
    resume.clear()
    return metrics
