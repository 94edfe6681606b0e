"""DP fine-tuning of one pre-trained model on one private task with one registered algorithm.

Epsilon in, noise out: the algorithm calibrates sigma from the target epsilon for the exact
number of Poisson-sampled steps this run will take; the ledger then records every release that
was actually made, and the reported epsilon is recomputed from that history.
Validation accuracy on the private validation split is reported per epoch but steers nothing
(no early stopping, no selection), so it costs no privacy; test accuracy is computed once, at
the end.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from dpadapter.algorithms import ALGORITHMS
from dpadapter.data import build_splits, public_train
from dpadapter.ground import distributed
from dpadapter.models import replace_head
from dpadapter.settings import STRATEGY_SEP, Config, join_folder
from dpadapter.train.checkpoint import load_model, save_model
from dpadapter.train.dp_fit import FitSettings, dp_fit, privacy_record
from dpadapter.train.dp_spec import run_spec
from dpadapter.train.job import seed_everything, training_job
from dpadapter.train.loops import evaluate, robust_accuracy
from dpadapter.train.phase_clock import PhaseClock
from dpadapter.train.resume import ResumeFile, resume_file_path
from dpadapter.train.strategies import get_strategy, released_dim


def resume_path(cfg: Config, wildcards: dict[str, str]) -> Path:
    """Resume state lives outside the job's outputs (Snakemake deletes those on failure); its
    folders are the outputs' (the algorithm's with a strategy besides finetune.strategy)."""
    return resume_file_path(cfg.results_dir, "finetune", *job_folders(wildcards))


def job_folders(w: dict[str, str]) -> tuple[str, ...]:
    """The folders of a job's outputs under finetune/ (workflow/rules/finetune.smk)."""
    algo = join_folder(w["algo"], w.get("strategy"))
    return (w["upstream"], w["task"], algo, f"eps{w['eps']}", f"seed{w['seed']}")


def for_strategy(cfg: Config, strategy: str | None) -> tuple[Config, dict[str, str]]:
    """The config a job of `strategy` trains with (None: finetune.strategy's own) and what its
    wildcards add: a strategy of the grid besides finetune.strategy is named, as in its folder."""
    if strategy is None:
        return cfg, {}
    if strategy == cfg.finetune.strategy:
        raise ValueError(
            f"strategy {strategy!r} is finetune.strategy: its jobs are in the algorithm's own "
            f"folder, without {STRATEGY_SEP}{strategy}"
        )
    get_strategy(strategy)  # an unknown name fails here, before any data is read
    return replace(cfg, finetune=replace(cfg.finetune, strategy=strategy)), {"strategy": strategy}


def run(
    cfg: Config,
    upstream: str,
    task: str,
    algo_name: str,
    eps: float,
    seed: int,
    ckpt: Path,
    out_dir: Path,
    strategy: str | None = None,
) -> dict:
    """One job; `strategy`: a tuning strategy of the grid other than finetune.strategy (its
    outputs are in `<algo>+<strategy>`, dpadapter.settings.split_folder)."""
    if algo_name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {algo_name!r}; known: {sorted(ALGORITHMS)}")
    if task not in cfg.tasks:
        raise KeyError(f"unknown task {task!r}; known: {sorted(cfg.tasks)}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be positive and finite, got {eps}")
    cfg, own_strategy = for_strategy(cfg, strategy)
    # the algorithm's own recipe where `finetune.recipes` has one (its jobs' fingerprint too)
    cfg = replace(cfg, finetune=cfg.finetune.for_algorithm(algo_name))
    seed_everything(seed)
    clock = PhaseClock()
    with clock.phase("data_and_checkpoint"):
        _, roles = build_splits(cfg, [task])
        data = roles[task]
        model, ckpt_meta = load_model(ckpt)
        replace_head(model, data.num_classes, seed)
    spec = run_spec(cfg, algo_name, eps, len(data.train), upstream, task)
    schedule = get_strategy(cfg.finetune.strategy).schedule(
        spec.total_steps, cfg.finetune.ut_t1_fraction
    )
    wildcards = {
        "upstream": upstream,
        "task": task,
        "algo": algo_name,
        "eps": f"{eps:g}",
        "seed": str(seed),
        **own_strategy,
    }
    resume = ResumeFile(
        resume_path(cfg, wildcards), identity=repr((spec, cfg.finetune, cfg.privacy, str(ckpt)))
    )
    state = resume.state
    run_id = state["mlflow_run_id"] if state else None
    with training_job(cfg, "finetune", wildcards, out_dir, resume_run_id=run_id) as (run_, metrics):
        metrics["epochs"] = list(state["epochs"]) if state else []
        if state:
            metrics["resumed_from_epoch"] = state["epoch"]
        # saved with every resume state: the epochs logged so far and the MLflow run to go on in
        resume.extra.update(epochs=metrics["epochs"], mlflow_run_id=run_.run_id)

        def log_epoch(epoch: int, stats: dict) -> None:
            stats = {"val_accuracy": float("nan"), **stats}  # dp_fit adds it if there is one
            run_.log_metrics(stats, step=epoch)
            metrics["epochs"].append({"epoch": epoch, **stats})

        algo, ledger = dp_fit(
            model,
            data.train,
            algo_name,
            spec,
            FitSettings.from_config(cfg),
            seed,
            public=public_train(cfg),
            on_epoch=log_epoch,
            resume=resume,
            schedule=schedule,
            val=data.val,
            label="finetune " + "/".join(job_folders(wildcards)),
            clock=clock,
        )
        with clock.phase("accountant_final"):
            epsilon = ledger.epsilon()
        if epsilon > eps * 1.001:
            raise RuntimeError(f"spent epsilon {epsilon:.4f} exceeds the target {eps}")
        if not distributed.world().writer:
            # another rank of a multi-process job: its replica equals rank 0's, which
            # evaluates and writes the job's files (metrics.json, model.pt, the MLflow run)
            metrics.update(test_accuracy=float("nan"), privacy={"epsilon": epsilon})
            return metrics
        r = cfg.robustness
        hyper = {
            **algo.describe(),
            "lr": cfg.finetune.lr,
            "momentum": cfg.finetune.momentum,
            "epochs": spec.epochs,
            "expected_batch_size": spec.expected_batch_size,
            "max_grad_norm": spec.max_grad_norm,
            "grad_sample_mode": cfg.finetune.grad_sample_mode,
            "grad_sample_mode_run": algo.grad_sample_mode,
            "physical_batch_size": cfg.finetune.physical_batch_size,
            "compile": cfg.finetune.compile,
            "seed": seed,
            "n_train": len(data.train),
            "strategy": schedule.strategy,
            "t1": schedule.t1,
        }
        run_.log_params(hyper)
        check = algo.per_sample_check or {}
        run_.set_tags(
            {"dp.per_example_clipping": "verified" if check.get("passed") else "unverified"}
        )
        with clock.phase("evaluation_clean"):
            test_accuracy = evaluate(model, data.test)
            val_accuracy = evaluate(model, data.val) if len(data.val) else None
        with clock.phase("evaluation_robust"):
            test_robust = robust_accuracy(model, data.test, r.noise_std, r.draws, r.seed)
        metrics.update(
            {
                "test_accuracy": test_accuracy,
                "val_accuracy": val_accuracy,
                "test_robust_accuracy": test_robust,
                "robustness": {"noise_std": r.noise_std, "draws": r.draws, "seed": r.seed},
                "hyperparameters": hyper,
                # bk only: how each layer's per-example norms were computed (ghost/per-example)
                "clipping_plan": algo.clipping_plan or None,
                # the per-sample mode's norms against torch.func's before training (None: off)
                "per_sample_check": algo.per_sample_check,
                # modules run with frozen (public) statistics (per_sample.independence)
                "frozen_statistics": algo.frozen_statistics,
                "privacy": {
                    **privacy_record(spec, ledger, eps, epsilon),
                    "validation_use": "reported only; selects nothing, so it is not charged",
                    "phases": [
                        {**ph, "released_dim": released_dim(model, ph["phase"])}
                        for ph in schedule.phases()
                    ],
                    **({"mechanism_note": algo.mechanism_note} if algo.mechanism_note else {}),
                },
            }
        )
        run_.log_metrics(
            {
                "test_accuracy": metrics["test_accuracy"],
                "test_robust_accuracy": metrics["test_robust_accuracy"],
                "epsilon": epsilon,
                "noise_multiplier": algo.sigma,
                "steps": ledger.steps,
            }
        )
        with clock.phase("checkpoint_write"):
            metrics["checkpoint"] = save_model(
                out_dir / "model.pt",
                model,
                # the backbone it was loaded as (an external one is not cfg.model)
                ckpt_meta["model"],
                data.num_classes,
                ckpt_meta["in_chans"],
                {"task": task},
            )
        # phases of this job, in seconds (bench/cpu/overhead.py adds them up over a run)
        metrics["timing_s"] = clock.record()
    if distributed.world().writer:
        resume.clear()
    return metrics
