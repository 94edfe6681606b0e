"""The DP training loop: one algorithm, Poisson batches, a ledger, resumable at epoch ends.

Fine-tuning, HPO trials and the audit all train through `dp_fit`, so what a release is, how
a resumed run continues and which per-sample mode clips are the same for all of them. The
loop is written here because Opacus' `make_private` has no notion of the pipeline's strategies
(what each step trains), of step budgets that stop mid-epoch, or of restoring every RNG.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dpadapter.algorithms import ALGORITHMS, DPRunSpec
from dpadapter.ground import device as devices
from dpadapter.ground import distributed
from dpadapter.models.batchnorm import freeze_batchnorm
from dpadapter.per_sample import (
    check_memo,
    effective_mode,
    make_precision,
    wrap_for_dp,
)
from dpadapter.privacy import PrivacyLedger, randomness, verify_plan
from dpadapter.settings import Config
from dpadapter.train.batching import PAD_LABEL, dp_batches, masked_cross_entropy
from dpadapter.train.dp_spec import padding
from dpadapter.train.loops import evaluate, progress
from dpadapter.train.phase_clock import NO_CLOCK, PhaseClock
from dpadapter.train.progress import ProgressLine
from dpadapter.train.resume import ResumeFile
from dpadapter.train.strategies import Schedule, apply_phase, every_phase_trains


@dataclass(frozen=True)
class FitSettings:
    """The optimiser and placement settings of a DP fit (from `finetune.*`, `device`, `tf32`)."""

    lr: float
    momentum: float
    grad_sample_mode: str
    physical_batch_size: int | None
    pad_batches: bool | str
    device: str
    tf32: bool
    # The base optimizer the DP optimizer wraps: "sgd" (with `momentum`) or "adam" (DP-Adam:
    # Adam's moments of the privatised gradient, post-processing; DP-SAT Table 3 fine-tunes
    # with it), with torch's default betas and eps.
    optimizer: str = "sgd"
    # autocast of the DP step's forward/backward (per_sample.precision); fp32: none
    precision: str = "fp32"
    per_sample_check: bool = True  # the wrap-time self-test (per_sample.self_test)
    bn_affine: str = "train"
    # privacy.randomness: noise and Poisson masks from the seed, or from the OS (secret)
    randomness: str = "seeded"
    # the results folder's memo of passed self-tests (per_sample.check_memo); None: every fit
    # runs the self-test
    per_sample_check_memo: str | None = None
    # torch.compile of bk's step (per_sample.compiled): off or torch.compile's mode
    compile: str = "off"

    @classmethod
    def from_config(cls, cfg: Config, lr: float | None = None) -> FitSettings:
        ft = cfg.finetune
        return cls(
            lr=ft.lr if lr is None else lr,
            momentum=ft.momentum,
            grad_sample_mode=ft.grad_sample_mode,
            physical_batch_size=ft.physical_batch_size,
            pad_batches=ft.pad_batches,
            device=cfg.device,
            tf32=cfg.tf32,
            optimizer=ft.optimizer,
            precision=ft.precision,
            per_sample_check=ft.per_sample_check,
            bn_affine=ft.bn_affine,
            randomness=cfg.privacy.randomness,
            per_sample_check_memo=check_memo.memo_path(cfg.results_dir),
            compile=ft.compile,
        )


def base_optimizer(settings: FitSettings, params) -> torch.optim.Optimizer:
    if settings.optimizer == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum)
    if settings.optimizer == "adam":
        return torch.optim.Adam(params, lr=settings.lr)
    raise ValueError(f"unknown finetune.optimizer {settings.optimizer!r}; known: sgd, adam")


def dp_fit(
    model: nn.Module,
    train: TensorDataset,
    algo_name: str,
    spec: DPRunSpec,
    settings: FitSettings,
    seed: int,
    *,
    public: Dataset | Callable[[], Dataset] | None = None,
    on_epoch: Callable[[int, dict], None] | None = None,
    resume: ResumeFile | None = None,
    max_steps: int | None = None,
    schedule: Schedule | None = None,
    val: TensorDataset | None = None,
    label: str | None = None,
    clock: PhaseClock = NO_CLOCK,
):
    """Train `model` in place with the algorithm; return (algorithm, ledger).

    `public` is the public data handed to algorithms that need it (GEP's anchors), or a
    function that loads it (read only when the algorithm needs it).

    `schedule` (dpadapter.train.strategies) picks what each step trains, clips and noises: the head
    only (HT) or every parameter (FT), switching after step T1 for UT. None trains every
    parameter (full fine-tuning).

    `max_steps` (optional) stops after that many releases, i.e. optimizer steps, mid-epoch if
    need be: the HPO stages count steps, not epochs, and may run a prefix of a schedule that was
    calibrated for more steps (a prefix spends at most the target). None runs every epoch.

    `resume` (optional) holds the state an earlier attempt saved at the end of an epoch: model,
    optimizer (momentum), algorithm state, privacy ledger and every RNG; the loop saves there
    after every epoch but the last. Restoring all of them makes the resumed run take exactly the
    batches, noise and releases of an uninterrupted one, and its ledger keeps the releases made
    before the interruption.

    `clock` (optional) adds this fit's seconds by phase: the wrap-time checks, the private
    steps, the per-epoch accountant and validation, and saving the resume state.
    """
    # BatchNorm kept from (non-private) pre-training is frozen before anything reads the model's
    # parameters (a no-op without BatchNorm): its statistics stay the public ones.
    freeze_batchnorm(model, settings.bn_affine)
    if schedule is not None:
        apply_phase(model, schedule.phase(0))
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ValueError(f"model is not DP-compatible: {errors}")
    dev = devices.resolve(settings.device)
    devices.configure(dev, settings.tf32)
    model.to(dev)
    # Several processes (torchrun): this one trains on its shard, sampled at the same q; the
    # optimizer sums the ranks' clipped sums and adds the noise once (dpadapter.ground.distributed).
    world = distributed.world()
    refusal = ALGORITHMS[algo_name].distributed_refusal if world.multi else None
    if refusal:
        raise ValueError(f"{algo_name} cannot run in {world.size} processes: {refusal}")
    train = devices.place(distributed.shard(train, world), dev)
    ledger = PrivacyLedger(spec.delta, spec.accountant)
    # The mechanism's noise is drawn on the parameters' device (Opacus needs the generator there).
    secret = settings.randomness == randomness.SECRET
    if secret:
        noise_gen = randomness.secret_generator(dev)
    else:
        noise_gen = devices.generator(dev, 10_000 + seed)
    with clock.phase("calibration"):
        algo = ALGORITHMS[algo_name](spec, ledger, noise_gen)
    if algo.needs_public_data:
        # GEP's anchor subspace comes from public gradients only (no privacy cost).
        if public is None:
            raise ValueError(f"{algo_name} needs public data: pass `public`")
        algo.set_public_data(public() if callable(public) else public)
    needs_samples = algo.needs_per_sample_gradients
    # a rank's Poisson batch is about 1/k of the job's: its padded size follows its own mean
    local = spec if not world.multi else _per_rank(spec, world.size)
    compiled = settings.compile != "off"
    pad = padding(settings.pad_batches, settings.physical_batch_size, dev, local, compiled)
    # The independence check and the self-test draw synthetic inputs of the data's sample
    # shape (no private value is read), the self-test as many as a physical batch will hold.
    x = train.tensors[0]
    # the checks test every parameter the run will train: the union of the strategy's phases
    with every_phase_trains(model, schedule):
        gsm = wrap_for_dp(
            model,
            settings.grad_sample_mode,
            needs_samples,
            (x.shape[1:], x.dtype),
            check=settings.per_sample_check,
            check_batch=pad or settings.physical_batch_size or local.expected_batch_size,
            check_memo_path=settings.per_sample_check_memo,
            compile=settings.compile,
            phase=clock.phase,
        )
    algo.grad_sample_mode = effective_mode(settings.grad_sample_mode, needs_samples)
    algo.per_sample_check = gsm.per_sample_check
    algo.frozen_statistics = list(gsm.independence.frozen)
    base_opt = base_optimizer(settings, gsm.parameters())
    algo.precision = make_precision(settings.precision, dev)
    optimizer = algo.make_optimizer(base_opt, gsm)
    if secret:
        sample_gen = randomness.secret_generator()
    else:
        sample_gen = torch.Generator().manual_seed(distributed.sample_seed(seed, world))
    loader = dp_batches(
        train,
        spec.sample_rate,
        sample_gen,
        dev,
        max_physical=pad or settings.physical_batch_size,
        pad=pad is not None,
        optimizer=optimizer,
    )
    releases = getattr(loader, "logical_batches", len(loader))
    assert releases == spec.steps_per_epoch, (releases, spec.steps_per_epoch)
    first_epoch = 0
    state = resume.state if resume is not None else None
    if state is not None:
        model.load_state_dict(state["model"])
        base_opt.load_state_dict(state["optimizer"])
        # read onto the CPU (ResumeFile): the algorithm's tensors follow the parameters
        first = next(model.parameters())
        algo.load_state_dict(state["algorithm"], device=first.device, dtype=first.dtype)
        ledger.history = PrivacyLedger.from_state_dict(state["ledger"]).history
        if not secret:  # secret: the mechanism's draws have no state; nothing to restore
            noise_gen.set_state(state["noise_rng"])
            sample_gen.set_state(_own(state["sample_rng"], world))
        devices.set_rng_state(_own(state["torch_rng"], world))
        first_epoch = state["epoch"]
        if schedule is not None:
            apply_phase(model, schedule.phase(ledger.steps))
    # sigma may come from the calibration memo or the resume state: its plan is recomputed by
    # the accountant, and refused if it overspends, before the first private step
    with clock.phase("calibration"):
        verify_plan(
            algo.planned_history(),
            spec.delta,
            spec.accountant,
            spec.target_epsilon,
            label or algo_name,
        )
    loss_fn = masked_cross_entropy if pad is not None else nn.functional.cross_entropy
    gsm.train()
    # One line per epoch (and every few minutes within long ones) in the job's log; `val`
    # (optional) adds the validation accuracy, which is reported only and steers nothing.
    total_steps = spec.total_steps if max_steps is None else min(spec.total_steps, max_steps)
    report = ProgressLine(label or algo_name, total_steps, start_step=ledger.steps)
    if not world.writer:  # one log line per step of the job, not one per process
        report.step = report.epoch = lambda *a, **k: None  # type: ignore[method-assign]
    for epoch in range(first_epoch, spec.epochs):
        if max_steps is not None and ledger.steps >= max_steps:
            break
        algo.start_epoch(epoch)
        # The epoch's loss is summed where the steps run, in float64 as a Python sum would be:
        # reading a step's loss would make a GPU wait for it at every step (issue 47).
        total: torch.Tensor | float = 0.0
        n: torch.Tensor | int = 0
        steps_started = time.perf_counter()
        for x, y in progress(loader, desc=f"{algo_name} epoch {epoch + 1}/{spec.epochs}"):
            loss = algo.train_step(gsm, x, y, loss_fn)
            if schedule is not None:
                apply_phase(model, schedule.phase(ledger.steps))
            if len(y):
                # padded rows add zero loss but count in len(y)
                total = total + torch.as_tensor(loss, dtype=torch.float64) * len(y)
                n = n + ((y != PAD_LABEL).sum() if pad is not None else len(y))
            if max_steps is not None and ledger.steps >= max_steps:
                break
            report.step(ledger.steps, loss)
        clock.add("private_steps", time.perf_counter() - steps_started)
        with clock.phase("accountant_per_epoch"):
            stats = {
                "train_loss": float(total) / max(1, int(n)),
                "steps": ledger.steps,
                "epsilon_spent": ledger.epsilon(),
                "noise_multiplier": algo.noise_multiplier(epoch),
                **algo.epoch_stats(),
            }
        if val is not None and len(val):
            with clock.phase("validation_per_epoch"):
                stats["val_accuracy"] = evaluate(model, val)
        if on_epoch is not None:
            on_epoch(epoch + 1, stats)
        report.epoch(epoch + 1, spec.epochs, stats)
        if max_steps is not None and ledger.steps >= max_steps:
            break
        if resume is not None and epoch + 1 < spec.epochs:
            # each rank's sampler and torch RNG (the replicas' other state is equal); one
            # collective on every rank, one file from rank 0
            sample_rng = _mine(sample_gen.get_state(), world)
            torch_rng = _mine(devices.rng_state(dev), world)
            if world.writer:
                with clock.phase("resume_state"):
                    resume.save(
                        {
                            "epoch": epoch + 1,
                            "model": model.state_dict(),
                            "optimizer": base_opt.state_dict(),
                            "algorithm": algo.state_dict(),
                            "ledger": ledger.state_dict(),
                            "noise_rng": noise_gen.get_state(),
                            "sample_rng": sample_rng,
                            "torch_rng": torch_rng,
                            "processes": world.size,
                        }
                    )
    algo.clipping_plan = dict(getattr(gsm, "last_plan", {}))
    if hasattr(gsm, "_close"):
        gsm._close()  # drop the per-sample hooks; evaluation uses the plain module
    return algo, ledger


def _per_rank(spec: DPRunSpec, processes: int) -> DPRunSpec:
    """The spec as one rank sees its shard: the same q, 1/k of the expected batch."""
    return dataclasses.replace(
        spec, expected_batch_size=max(1, math.ceil(spec.expected_batch_size / processes))
    )


def _mine(state, world: distributed.World):
    """A per-process state as saved: itself (one process) or every rank's, in rank order."""
    return distributed.gather(state) if world.multi else state


def _own(saved, world: distributed.World):
    """This rank's part of a per-process state saved by `_mine`."""
    return saved[world.rank] if world.multi else saved


def privacy_record(spec: DPRunSpec, ledger: PrivacyLedger, target: float, epsilon: float) -> dict:
    """What metrics.json says of a DP fit's guarantee: sigma's inputs, the history, epsilon.

    `epsilon` is the ledger's, recomputed from the releases actually made (the caller has it
    already and checked it against the target). Stages add their own notes after these keys.
    """
    return {
        "mechanism": "gaussian",
        "accountant": spec.accountant,
        "target_epsilon": target,
        "epsilon": epsilon,
        "delta": spec.delta,
        "steps": ledger.steps,
        "sample_rate": spec.sample_rate,
        "sampling": "poisson",
        "history": ledger.state_dict()["history"],
    }
