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
import os
from pathlib import Path

import torch
from opacus.validators import ModuleValidator
from torch import nn

from dpadapter import device as devices
from dpadapter.algorithms import ALGORITHMS, DPRunSpec
from dpadapter.config import Config
from dpadapter.data import build_splits
from dpadapter.models import replace_head
from dpadapter.privacy import PrivacyLedger
from dpadapter.stages.job import seed_everything, training_job
from dpadapter.strategies import Schedule, apply_phase, get_strategy, released_dims
from dpadapter.train.batching import (
    PAD_LABEL,
    dp_batches,
    masked_cross_entropy,
    padded_size,
    wants_padding,
)
from dpadapter.train.checkpoint import load_model, save_model
from dpadapter.train.loops import evaluate, progress, robust_accuracy
from dpadapter.train.per_sample import bind_optimizer, effective_mode, wrap_for_dp
from dpadapter.train.progress import ProgressLine


def sample_rate(batch_size: int, n_train: int, rule: str) -> float:
    """The Poisson rate q of a logical batch of expected size `batch_size`.

    Two readings of "batch size B" exist in the DP literature's code: q = B / n (the expected
    batch is B), and Opacus' `make_private` on a `DataLoader(batch_size=B)`, which samples at
    q = 1 / len(loader) = 1 / ceil(n / B) (the DP-SAT paper's code: 48,000 examples and
    B = 2048 give q = 1/24 and an expected batch of 2000). Either way the accountant sees q.
    """
    if rule == "loader":
        return 1.0 / math.ceil(n_train / batch_size)
    if rule == "batch_size":
        return batch_size / n_train
    raise ValueError(f"unknown finetune.sample_rate_from {rule!r}")


def run_spec(cfg: Config, algo: str, eps: float, n_train: int) -> DPRunSpec:
    ft = cfg.finetune
    if ft.batch_size > n_train:
        raise ValueError(
            f"finetune.batch_size={ft.batch_size} exceeds the task's {n_train} training examples"
        )
    q = sample_rate(ft.batch_size, n_train, ft.sample_rate_from)
    return DPRunSpec(
        target_epsilon=eps,
        delta=cfg.privacy.delta,
        sample_rate=q,
        steps_per_epoch=int(1 / q),  # what Opacus' DPDataLoader yields per epoch
        epochs=ft.epochs,
        # the mean batch n * q, by which Opacus divides the noisy sum: B itself, or under the
        # loader reading n / ceil(n / B) rounded (2000 for n = 48,000 and B = 2048)
        expected_batch_size=ft.batch_size
        if ft.sample_rate_from == "batch_size"
        else round(n_train * q),
        max_grad_norm=ft.max_grad_norm,
        accountant=cfg.privacy.accountant,
        params=dict(ft.algo_params.get(algo, {})),
        calibration_cache=str(Path(cfg.results_dir) / ".cache" / "sigma.json"),
    )


def padding(cfg: Config, dev: torch.device, spec: DPRunSpec) -> int | None:
    """Fixed physical batch size to pad to, or None (no padding).

    `finetune.pad_batches: auto` pads on CUDA only (cuDNN autotunes per shape; see
    dpadapter.train.batching) to `physical_batch_size`, or to a size a Poisson batch rarely
    exceeds. On the CPU nothing is padded unless asked: results stay exactly as before.
    """
    if not wants_padding(cfg.finetune.pad_batches, dev):
        return None
    return cfg.finetune.physical_batch_size or padded_size(
        spec.expected_batch_size, spec.sample_rate
    )


def dp_train(
    model: nn.Module,
    train: torch.utils.data.TensorDataset,
    algo_name: str,
    spec: DPRunSpec,
    cfg: Config,
    seed: int,
    on_epoch=None,
    resume: dict | None = None,
    save_state=None,
    max_steps: int | None = None,
    schedule: Schedule | None = None,
    public: torch.utils.data.Dataset | None = None,
    val: torch.utils.data.TensorDataset | None = None,
    label: str | None = None,
):
    """Train `model` in place with the algorithm; return (algorithm, ledger).

    `public` (optional) is the public data handed to algorithms that need it (GEP's anchors);
    None builds the pipeline's public training split. The audit passes the public images in its
    own input layout.

    `schedule` (dpadapter.strategies) picks what each step trains, clips and noises: the head
    only (HT) or every parameter (FT), switching after step T1 for UT. None trains every
    parameter (full fine-tuning), as before.

    `max_steps` (optional) stops after that many releases, i.e. optimizer steps, mid-epoch if
    need be: the HPO stages count steps, not epochs, and may run a prefix of a schedule that was
    calibrated for more steps (a prefix spends at most the target). None runs every epoch.

    `resume` is a state written by `save_state` at the end of an earlier epoch: model,
    optimizer (momentum), algorithm state, privacy ledger and every RNG. Restoring all of them
    makes the resumed run take exactly the batches, noise and releases of an uninterrupted one,
    and its ledger keeps the releases made before the interruption.
    """
    if schedule is not None:
        apply_phase(model, schedule.phase(0))
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ValueError(f"model is not DP-compatible: {errors}")
    dev = devices.resolve(cfg.device)
    devices.configure(dev, cfg.tf32)
    model.to(dev)
    train = devices.place(train, dev)
    ledger = PrivacyLedger(spec.delta, spec.accountant)
    # The mechanism's noise is drawn on the parameters' device (Opacus needs the generator there).
    noise_gen = devices.generator(dev, 10_000 + seed)
    algo = ALGORITHMS[algo_name](spec, ledger, noise_gen)
    if algo.needs_public_data:
        # GEP's anchor subspace comes from public gradients only (no privacy cost).
        if public is None:
            public = build_splits(cfg, ["public"])[1]["public"].train
        algo.set_public_data(public)
    needs_samples = algo.needs_per_sample_gradients
    gsm = wrap_for_dp(model, cfg.finetune.grad_sample_mode, needs_samples)
    algo.grad_sample_mode = effective_mode(cfg.finetune.grad_sample_mode, needs_samples)
    base_opt = torch.optim.SGD(gsm.parameters(), lr=cfg.finetune.lr, momentum=cfg.finetune.momentum)
    optimizer = bind_optimizer(algo.make_optimizer(base_opt), gsm)
    sample_gen = torch.Generator().manual_seed(20_000 + seed)
    pad = padding(cfg, dev, spec)
    loader = dp_batches(
        train,
        spec.sample_rate,
        sample_gen,
        dev,
        max_physical=pad or cfg.finetune.physical_batch_size,
        pad=pad is not None,
        optimizer=optimizer,
    )
    releases = getattr(loader, "logical_batches", len(loader))
    assert releases == spec.steps_per_epoch, (releases, spec.steps_per_epoch)
    first_epoch = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        base_opt.load_state_dict(resume["optimizer"])
        # read onto the CPU (finetune.run): the algorithm's tensors follow the parameters
        first = next(model.parameters())
        algo.load_state_dict(resume["algorithm"], device=first.device, dtype=first.dtype)
        ledger.history = PrivacyLedger.from_state_dict(resume["ledger"]).history
        noise_gen.set_state(resume["noise_rng"])
        sample_gen.set_state(resume["sample_rng"])
        devices.set_rng_state(resume["torch_rng"])
        first_epoch = resume["epoch"]
        if schedule is not None:
            apply_phase(model, schedule.phase(ledger.steps))
    loss_fn = masked_cross_entropy if pad is not None else nn.functional.cross_entropy
    gsm.train()
    # One line per epoch (and every few minutes within long ones) in the job's log; `val`
    # (optional) adds the validation accuracy, which is reported only and steers nothing.
    total_steps = spec.total_steps if max_steps is None else min(spec.total_steps, max_steps)
    report = ProgressLine(label or algo_name, total_steps, start_step=ledger.steps)
    for epoch in range(first_epoch, spec.epochs):
        if max_steps is not None and ledger.steps >= max_steps:
            break
        algo.start_epoch(epoch)
        total, n = 0.0, 0
        for x, y in progress(loader, desc=f"{algo_name} epoch {epoch + 1}/{spec.epochs}"):
            loss = algo.train_step(gsm, x, y, loss_fn)
            if schedule is not None:
                apply_phase(model, schedule.phase(ledger.steps))
            if len(y):
                total += loss * len(y)  # padded rows add zero loss but count in len(y)
                n += int((y != PAD_LABEL).sum()) if pad is not None else len(y)
            if max_steps is not None and ledger.steps >= max_steps:
                break
            report.step(ledger.steps, loss)
        stats = {
            "train_loss": total / max(1, n),
            "steps": ledger.steps,
            "epsilon_spent": ledger.epsilon(),
            "noise_multiplier": algo.noise_multiplier(epoch),
        }
        if val is not None and len(val):
            stats["val_accuracy"] = evaluate(model, val)
        if on_epoch is not None:
            on_epoch(epoch + 1, stats)
        report.epoch(epoch + 1, spec.epochs, stats)
        if max_steps is not None and ledger.steps >= max_steps:
            break
        if save_state is not None and epoch + 1 < spec.epochs:
            save_state(
                {
                    "epoch": epoch + 1,
                    "model": model.state_dict(),
                    "optimizer": base_opt.state_dict(),
                    "algorithm": algo.state_dict(),
                    "ledger": ledger.state_dict(),
                    "noise_rng": noise_gen.get_state(),
                    "sample_rng": sample_gen.get_state(),
                    "torch_rng": devices.rng_state(dev),
                }
            )
    algo.clipping_plan = dict(getattr(gsm, "last_plan", {}))
    if hasattr(gsm, "_close"):
        gsm._close()  # drop the per-sample hooks; evaluation uses the plain module
    return algo, ledger


def resume_path(cfg: Config, wildcards: dict[str, str]) -> Path:
    """Resume state lives outside the job's outputs (Snakemake deletes those on failure)."""
    w = wildcards
    return (
        Path(cfg.results_dir)
        / ".resume"
        / "finetune"
        / w["upstream"]
        / w["task"]
        / w["algo"]
        / f"eps{w['eps']}"
        / f"seed{w['seed']}"
        / "state.pt"
    )


def _save_atomic(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run(
    cfg: Config,
    upstream: str,
    task: str,
    algo_name: str,
    eps: float,
    seed: int,
    ckpt: Path,
    out_dir: Path,
) -> dict:
    if algo_name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {algo_name!r}; known: {sorted(ALGORITHMS)}")
    if task not in cfg.tasks:
        raise KeyError(f"unknown task {task!r}; known: {sorted(cfg.tasks)}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be positive and finite, got {eps}")
    seed_everything(seed)
    _, roles = build_splits(cfg, [task])
    data = roles[task]
    model, ckpt_meta = load_model(ckpt)
    replace_head(model, data.num_classes, seed)
    spec = run_spec(cfg, algo_name, eps, len(data.train))
    schedule = get_strategy(cfg.finetune.strategy).schedule(
        spec.total_steps, cfg.finetune.ut_t1_fraction
    )
    wildcards = {
        "upstream": upstream,
        "task": task,
        "algo": algo_name,
        "eps": f"{eps:g}",
        "seed": str(seed),
    }
    state_file = resume_path(cfg, wildcards)
    resume = (
        torch.load(state_file, map_location="cpu", weights_only=False)
        if state_file.is_file()
        else None
    )
    identity = repr((spec, cfg.finetune, cfg.privacy, str(ckpt)))
    if resume is not None and resume.get("identity") != identity:
        print(f"warning: ignoring resume state {state_file}: written for another configuration")
        resume = None
    run_id = resume["mlflow_run_id"] if resume else None
    with training_job(cfg, "finetune", wildcards, out_dir, resume_run_id=run_id) as (run_, metrics):
        metrics["epochs"] = list(resume["epochs"]) if resume else []
        if resume:
            metrics["resumed_from_epoch"] = resume["epoch"]

        def log_epoch(epoch: int, stats: dict) -> None:
            stats = {"val_accuracy": float("nan"), **stats}  # dp_train adds it if there is one
            run_.log_metrics(stats, step=epoch)
            metrics["epochs"].append({"epoch": epoch, **stats})

        def save_state(state: dict) -> None:
            _save_atomic(
                {
                    **state,
                    "epochs": metrics["epochs"],
                    "mlflow_run_id": run_.run_id,
                    "identity": identity,
                },
                state_file,
            )

        algo, ledger = dp_train(
            model,
            data.train,
            algo_name,
            spec,
            cfg,
            seed,
            on_epoch=log_epoch,
            resume=resume,
            save_state=save_state,
            schedule=schedule,
            val=data.val,
            label=f"finetune {upstream}/{task}/{algo_name}/eps{eps:g}/seed{seed}",
        )
        epsilon = ledger.epsilon()
        if epsilon > eps * 1.001:
            raise RuntimeError(f"spent epsilon {epsilon:.4f} exceeds the target {eps}")
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
            "seed": seed,
            "n_train": len(data.train),
            "strategy": schedule.strategy,
            "t1": schedule.t1,
        }
        run_.log_params(hyper)
        metrics.update(
            {
                "test_accuracy": evaluate(model, data.test),
                "val_accuracy": evaluate(model, data.val) if len(data.val) else None,
                "test_robust_accuracy": robust_accuracy(
                    model, data.test, r.noise_std, r.draws, r.seed
                ),
                "robustness": {"noise_std": r.noise_std, "draws": r.draws, "seed": r.seed},
                "hyperparameters": hyper,
                # bk only: how each layer's per-example norms were computed (ghost/per-example)
                "clipping_plan": algo.clipping_plan or None,
                "privacy": {
                    "mechanism": "gaussian",
                    "accountant": spec.accountant,
                    "target_epsilon": eps,
                    "epsilon": epsilon,
                    "delta": spec.delta,
                    "steps": ledger.steps,
                    "sample_rate": spec.sample_rate,
                    "sampling": "poisson",
                    "history": ledger.state_dict()["history"],
                    "validation_use": "reported only; selects nothing, so it is not charged",
                    "phases": [
                        {**ph, "released_dim": released_dims(model)[ph["phase"]]}
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
        metrics["checkpoint"] = save_model(
            out_dir / "model.pt",
            model,
            cfg.model,
            data.num_classes,
            ckpt_meta["in_chans"],
            {"task": task},
        )
    state_file.unlink(missing_ok=True)
    return metrics
