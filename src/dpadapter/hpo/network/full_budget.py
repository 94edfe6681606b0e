"""One training run at a whole (final) budget, evaluated on validation and test: the final run
of the linear scaling rule and every baseline run of the network regime share it, so that they
differ only in the configuration and budget they are given.
"""

from __future__ import annotations

from pathlib import Path

from dpadapter.hpo.network.runner import count_correct, strategy_of, train_config
from dpadapter.hpo.space import StepConfig, step_dict
from dpadapter.settings import Config


def final_budget_run(
    cfg: Config,
    p: dict,
    stage: str,
    role: str,
    config: StepConfig,
    target: float,
    seed: int,
    ckpt: Path,
    out_dir: Path,
    extra_wildcards: dict[str, str] | None = None,
    calibrated_steps: int | None = None,
    save: bool = True,
    annotate=None,
) -> dict:
    """Train at a final budget, evaluate on validation and test; return the metrics.

    `annotate(metrics, history)` runs inside the job, before metrics.json is written and
    attached to the MLflow run, to add the stage's own block (e.g. the HPO total).
    """
    from dpadapter.data import build_splits
    from dpadapter.train.checkpoint import save_model
    from dpadapter.train.dp_fit import privacy_record
    from dpadapter.train.job import training_job

    _, roles = build_splits(cfg, [p["task"]])
    d = roles[p["task"]]
    wildcards = {
        "upstream": p["upstream"],
        "task": p["task"],
        "algo": p["algorithm"],
        "seed": str(p["seed"]),
        **(extra_wildcards or {}),
    }
    with training_job(cfg, stage, wildcards, out_dir, parent_run_id=p["parent_run_id"]) as (
        run,
        metrics,
    ):
        run.set_tags({"hpo.role": role})
        res = train_config(
            cfg,
            d.train,
            d.num_classes,
            ckpt,
            p["algorithm"],
            config,
            target,
            seed,
            calibrated_steps=calibrated_steps,
        )
        spent = res.ledger.epsilon()
        if spent > target * (1 + 1e-3):
            raise RuntimeError(f"{stage} spent epsilon {spent:.4f} > its target {target}")
        hyper = {
            **res.algorithm.describe(),
            **step_dict(config),
            "seed": seed,
            "calibrated_steps": res.spec.total_steps,
            "momentum": cfg.finetune.momentum,
            "strategy": strategy_of(cfg).name,
            "expected_batch_size": res.spec.expected_batch_size,
            "max_grad_norm": res.spec.max_grad_norm,
            "n_train": len(d.train),
        }
        run.log_params(hyper)
        # Test accuracy is computed here, after every choice has been made, and steers nothing.
        test_acc = count_correct(res.model, d.test) / len(d.test)
        val_correct = count_correct(res.model, d.val)
        metrics.update(
            {
                "test_accuracy": test_acc,
                "val_correct": val_correct,
                "val_size": len(d.val),
                "hyperparameters": hyper,
                "privacy": privacy_record(res.spec, res.ledger, target, spent),
            }
        )
        run.log_metrics(
            {"test_accuracy": test_acc, "epsilon": spent, "steps": res.ledger.steps, "r": config.r}
        )
        if annotate is not None:
            annotate(metrics, tuple(res.ledger.history))
        if save:
            metrics["checkpoint"] = save_model(
                out_dir / "model.pt",
                res.model,
                res.checkpoint_meta["model"],
                d.num_classes,
                res.checkpoint_meta["in_chans"],
                {"task": p["task"], "hpo": role},
            )
    return metrics
