"""Drive any registered DP algorithm step by step on a tiny model, the way the stage does.

`logical_step` splits a logical batch into physical ones exactly as Opacus' BatchMemoryManager
does (the skip flag of a physical batch is queued before the batch is processed), so virtual
batching is exercised without a data loader; the integration tests use the real stage loop.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.algorithms import ALGORITHMS, DPAlgorithm, DPRunSpec
from dpadapter.models import create_model
from dpadapter.per_sample import wrap_for_dp
from dpadapter.privacy import PrivacyLedger
from dpadapter.settings import ModelConfig

# The per-sample mode `build` wraps in when none is given (test_privacy_suite sets it per test).
MODE = "hooks"
LOSS = nn.functional.cross_entropy
NUM_CLASSES = 5
# Calibrations (seconds each) are shared across the session; conftest points this at a file.
CALIBRATION_CACHE: str | None = None


def spec(**kw: Any) -> DPRunSpec:
    base = dict(
        target_epsilon=4.0,
        delta=1e-5,
        sample_rate=0.1,
        steps_per_epoch=10,
        epochs=2,
        expected_batch_size=12,
        max_grad_norm=1.0,
        accountant="rdp",
        calibration_cache=CALIBRATION_CACHE,
    )
    base.update(kw)
    return DPRunSpec(**base)


def tiny_model(seed: int = 0) -> nn.Module:
    return create_model(ModelConfig("cnn-gn", 4, 8), NUM_CLASSES, 1, seed=seed)


@contextmanager
def fixed_sigma(cls: type[DPAlgorithm], sigma: float | None) -> Iterator[None]:
    """Replace the calibrate phase (target epsilon -> sigma) by a fixed accounted sigma."""
    if sigma is None:
        yield
        return
    had = "calibrate" in cls.__dict__
    original = cls.__dict__.get("calibrate")
    cls.calibrate = lambda self: float(sigma)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            cls.calibrate = original  # type: ignore[method-assign]
        else:
            del cls.calibrate


@dataclass
class Run:
    algo: DPAlgorithm
    model: nn.Module
    gsm: nn.Module
    opt: DPOptimizer
    base_opt: torch.optim.Optimizer
    ledger: PrivacyLedger

    @property
    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.opt.params]


def build(
    algo: str | type[DPAlgorithm],
    run_spec: DPRunSpec,
    *,
    public: TensorDataset | None = None,
    sigma: float | None = None,
    seed: int = 0,
    lr: float = 0.1,
    momentum: float = 0.0,
    mode: str | None = None,
    model: nn.Module | None = None,
    audit: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Run:
    cls = ALGORITHMS[algo] if isinstance(algo, str) else algo
    ledger = PrivacyLedger(run_spec.delta, run_spec.accountant)
    with fixed_sigma(cls, sigma):
        a = cls(run_spec, ledger, torch.Generator().manual_seed(10_000 + seed))
    if a.needs_public_data:
        assert public is not None, f"{cls.name} needs public data"
        a.set_public_data(public)
    model = (tiny_model() if model is None else model).to(dtype)
    gsm = wrap_for_dp(model, mode or MODE, cls.needs_per_sample_gradients)
    base_opt = torch.optim.SGD(gsm.parameters(), lr=lr, momentum=momentum)
    opt = a.make_optimizer(base_opt, gsm)
    if audit:
        a.audit = []
    a.start_epoch(0)
    return Run(a, model, gsm, opt, base_opt, ledger)


def chunks(x: torch.Tensor, y: torch.Tensor, physical: int | None):
    if physical is None or len(y) <= physical:
        return [(x, y)]
    n = math.ceil(len(y) / physical)
    return list(zip(torch.tensor_split(x, n), torch.tensor_split(y, n), strict=True))


def logical_step(run: Run, x: torch.Tensor, y: torch.Tensor, physical: int | None = None) -> None:
    parts = chunks(x, y, physical)
    for i, (a, b) in enumerate(parts):
        run.opt.signal_skip_step(do_skip=i < len(parts) - 1)
        run.algo.train_step(run.gsm, a, b, LOSS)


def empty_step(run: Run) -> None:
    x = torch.zeros((0, 1, 16, 16))
    y = torch.zeros((0,), dtype=torch.long)
    logical_step(run, x, y)


def snapshot(run: Run) -> dict[str, Any]:
    """Everything the stage's resume state holds (see dpadapter.train.dp_fit)."""
    return copy.deepcopy(
        {
            "model": run.model.state_dict(),
            "optimizer": run.base_opt.state_dict(),
            "algorithm": run.algo.state_dict(),
            "ledger": run.ledger.state_dict(),
            "noise_rng": run.algo.generator.get_state(),
        }
    )


def restore(run: Run, state: dict[str, Any]) -> None:
    run.model.load_state_dict(state["model"])
    run.base_opt.load_state_dict(state["optimizer"])
    run.algo.load_state_dict(state["algorithm"])
    run.ledger.history = PrivacyLedger.from_state_dict(state["ledger"]).history
    run.algo.generator.set_state(state["noise_rng"])


def with_spec(run_spec: DPRunSpec, **kw: Any) -> DPRunSpec:
    return replace(run_spec, **kw)
