"""Train one (lr, T) configuration with any registered DP algorithm, reusing the fine-tuning code.

A run here differs from `stages.finetune.run` in three ways, each for the HPO's sake:
- it takes exactly T optimizer steps (`StepBudgetSpec`: sigma is calibrated for T releases,
  not for whole epochs), or a prefix of a schedule calibrated for more steps (the final run);
- the learning rate comes from the search, not from `finetune.lr`;
- selection-side runs only ever receive `PrivateData` (training and validation splits): the
  test split is not handed to any code that influences a choice.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.algorithms import ALGORITHMS, DPRunSpec
from dpadapter.hpo.accounting import merge_segments
from dpadapter.hpo.space import StepConfig
from dpadapter.privacy import PrivacyLedger, Segment
from dpadapter.settings import Config


@dataclass(frozen=True)
class StepBudgetSpec(DPRunSpec):
    """A run planned as exactly `steps` releases; its last epoch may be partial.

    `total_steps` is what every algorithm calibrates sigma for, so overriding it makes a
    constant-sigma algorithm spend exactly its target in `steps` steps. Schedule-based ones
    (AdpAlloc plans whole epochs) then over-plan a partial last epoch and spend less.
    """

    steps: int = 0

    @property
    def total_steps(self) -> int:
        return self.steps


@dataclass(frozen=True)
class PrivateData:
    """What selection may see: the task's training and validation splits, never its test split."""

    num_classes: int
    train: TensorDataset
    val: TensorDataset


def private_data(cfg: Config, task: str) -> PrivateData:
    from dpadapter.data import build_splits

    _, roles = build_splits(cfg, [task])
    d = roles[task]
    if len(d.val) == 0:
        raise ValueError(
            f"hpo needs a validation split to score trials: set tasks.{task}.n_val > 0"
        )
    return PrivateData(d.num_classes, d.train, d.val)


def task_sizes(cfg: Config, task: str) -> tuple[int, int]:
    """(n_train, n_val) of a task from the allocation alone (sizes are public; no images)."""
    from dpadapter.data.tasks import allocate, load_pools

    a = allocate(cfg, load_pools(cfg))[task]
    return int(a.train.numel()), int(a.val.numel())


def step_spec(
    cfg: Config, algo: str, target_epsilon: float, n_train: int, steps: int
) -> StepBudgetSpec:
    """The fine-tuning spec (batch size, clipping, accountant, algo params) for `steps` steps."""
    from dpadapter.train.dp_spec import run_spec

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base = run_spec(cfg, algo, target_epsilon, n_train)
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    kw["epochs"] = math.ceil(steps / base.steps_per_epoch)
    return StepBudgetSpec(**kw, steps=int(steps))


def planned_history(algo: str, spec: DPRunSpec) -> list[Segment]:
    """The releases a run of `spec` will record.

    Built from the algorithm's own schedule (`noise_multiplier(epoch)`, the accounted sigma),
    so it holds for every registered algorithm, before any data is read.
    """
    steps = spec.total_steps
    inst = ALGORITHMS[algo](spec, PrivacyLedger(spec.delta, spec.accountant), torch.Generator())
    spe = spec.steps_per_epoch
    segs = [
        Segment(float(inst.noise_multiplier(e)), spec.sample_rate, min(spe, steps - e * spe))
        for e in range(math.ceil(steps / spe))
    ]
    return merge_segments(segs)


def strategy_of(cfg: Config):
    """What the HPO's runs train (ft, ht = head only, ut): hpo.strategy, else finetune.strategy.

    The schedule spans the calibrated steps, so a UT final run that stops early (a prefix) keeps
    the T1 it was planned with.
    """
    from dpadapter.train.strategies import get_strategy

    return get_strategy(cfg.hpo.strategy or cfg.finetune.strategy)


@dataclass(frozen=True)
class TrainedRun:
    model: nn.Module
    checkpoint_meta: dict
    algorithm: object
    ledger: PrivacyLedger
    spec: StepBudgetSpec


def train_config(
    cfg: Config,
    train: TensorDataset,
    num_classes: int,
    ckpt: Path,
    algo: str,
    config: StepConfig,
    target_epsilon: float,
    seed: int,
    calibrated_steps: int | None = None,
) -> TrainedRun:
    """Fine-tune the checkpoint (new head) for `config.steps` steps at lr `config.lr`.

    sigma is calibrated for `calibrated_steps` (default: `config.steps`) at `target_epsilon`;
    taking fewer steps than calibrated runs a prefix of that schedule.
    """
    from dpadapter.data import public_train
    from dpadapter.models import replace_head
    from dpadapter.train.checkpoint import load_model
    from dpadapter.train.dp_fit import FitSettings, dp_fit
    from dpadapter.train.job import seed_everything

    calibrated_steps = calibrated_steps or config.steps
    if config.steps > calibrated_steps:
        raise ValueError(f"{config.steps} steps exceed the {calibrated_steps} calibrated for")
    seed_everything(seed)
    model, meta = load_model(ckpt)
    replace_head(model, num_classes, seed)
    spec = step_spec(cfg, algo, target_epsilon, len(train), calibrated_steps)
    settings = FitSettings.from_config(cfg, lr=config.lr)
    schedule = strategy_of(cfg).schedule(calibrated_steps, cfg.finetune.ut_t1_fraction)
    inst, ledger = dp_fit(
        model,
        train,
        algo,
        spec,
        settings,
        seed,
        public=public_train(cfg),
        max_steps=config.steps,
        schedule=schedule,
    )
    if ledger.steps != config.steps:
        raise RuntimeError(f"run made {ledger.steps} releases, expected {config.steps}")
    return TrainedRun(model, meta, inst, ledger, spec)


@torch.no_grad()
def count_correct(model: nn.Module, data: TensorDataset, batch_size: int = 1000) -> int:
    """Correct predictions (an integer: the selection mechanisms' sensitivity-1 score)."""
    was = model.training
    model.eval()
    x, y = data.tensors
    correct = 0
    for i in range(0, len(y), batch_size):
        correct += int((model(x[i : i + batch_size]).argmax(1) == y[i : i + batch_size]).sum())
    model.train(was)
    return correct
