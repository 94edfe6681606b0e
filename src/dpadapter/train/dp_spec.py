"""The DP run a fine-tuning config asks for: Poisson rate, steps, clipping, accountant, padding.

Every consumer of `finetune.*` that trains privately (the fine-tune stage, HPO trials, the
audit) builds its `DPRunSpec` here, so a run's sampling rate and calibration inputs are the
same wherever the same config is read.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dpadapter.algorithms import DPRunSpec
from dpadapter.settings import Config
from dpadapter.train.batching import padded_size, wants_padding


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


def run_spec(
    cfg: Config,
    algo: str,
    eps: float,
    n_train: int,
    upstream: str | None = None,
    task: str | None = None,
) -> DPRunSpec:
    """The run of `algo` at `eps`; its params are those for (upstream, task) when given."""
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
        params=ft.params_of(algo, upstream, task),
        calibration_cache=str(Path(cfg.results_dir) / ".cache" / "sigma.json"),
    )


def padding(
    pad_batches: bool | str,
    physical: int | None,
    dev: torch.device,
    spec: DPRunSpec,
    compiled: bool = False,
):
    """Fixed physical batch size to pad to, or None (no padding).

    `finetune.pad_batches: auto` pads on CUDA (cuDNN autotunes per shape; see
    dpadapter.train.batching) and for a `compiled` step (one graph per shape), to
    `physical_batch_size`, or to a size a Poisson batch rarely exceeds. An eager step on the
    CPU is not padded unless asked: results stay exactly as before.
    """
    if not wants_padding(pad_batches, dev, compiled):
        return None
    return physical or padded_size(spec.expected_batch_size, spec.sample_rate)
