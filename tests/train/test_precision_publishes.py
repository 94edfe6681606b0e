"""fp16's loss scale reacts to the private data (it is halved when a batch's per-example
gradients overflow), so nothing of its course may be published outside the accounting, and no
run may stop because of it: what a run publishes about its precision is its configuration, and
a batch that overflows at every scale is computed in fp32 instead of ending the run.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from torch import nn
from torch.nn import functional as F

import dpadapter.train.dp_fit as fit
from dpadapter.data import build_splits
from dpadapter.models import create_model
from dpadapter.per_sample import wrap_for_dp
from dpadapter.per_sample.precision import Precision
from dpadapter.settings import ModelConfig
from dpadapter.train.dp_spec import run_spec


def _fit_fp16(cfg, overflows: int):
    """Three fp16 steps of dp_fit; the first `overflows` overflow checks report an overflow."""
    real = Precision._finite
    calls = []

    def finite(self):
        calls.append(1)
        return False if len(calls) <= overflows else real(self)

    Precision._finite = finite
    try:
        ft = dataclasses.replace(cfg.finetune, grad_sample_mode="hooks", precision="fp16")
        cfg = dataclasses.replace(cfg, finetune=ft)
        _, roles = build_splits(cfg, ["syn-same"])
        train = roles["syn-same"].train
        spec = dataclasses.replace(run_spec(cfg, "dpsgd", 2.0, len(train)), epochs=1)
        model = create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0)
        settings = fit.FitSettings.from_config(cfg)
        algo, _ = fit.dp_fit(model, train, "dpsgd", spec, settings, 0, max_steps=3)
    finally:
        Precision._finite = real
    return algo


def test_published_hyperparameters_do_not_depend_on_which_batches_overflowed(tiny_cfg):
    clean = _fit_fp16(tiny_cfg, 0)
    overflowed = _fit_fp16(tiny_cfg, 5)  # the first batch's natural overflows, and more
    # the scale did react to the overflows ...
    assert overflowed.precision.scaler.recomputations > clean.precision.scaler.recomputations
    assert overflowed.describe() == clean.describe()  # ... and the record says nothing of it
    assert clean.describe()["precision"] == "fp16"


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_batch_that_overflows_at_every_scale_is_computed_in_fp32_not_a_stop(mode):
    """Inputs beyond fp16's range: no scale helps. The run goes on with this batch's gradient
    in fp32 (the same clipped sum as an fp32 run's, bit for bit), and the scale the next batch
    starts from is the one this batch started from."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(4, 12, generator=g) * 1e6, torch.randint(0, 5, (4,), generator=g)
    sums = {}
    for name in ("fp32", "fp16"):
        gsm = wrap_for_dp(copy.deepcopy(model), mode)
        prec = Precision(name)
        if prec.scaler is not None:
            prec.scaler.max_recomputations = 3
        opt = dp_sgd(gsm, 1.0, 4, precision=prec)
        prec.gradient(gsm, x, y, F.cross_entropy)
        opt.clip_and_accumulate()
        sums[name] = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
        if prec.scaler is not None:
            assert prec.scaler.recomputations == 3
            assert prec.scaler.scale == 2.0**16  # the next batch starts where this one did
    assert torch.isfinite(sums["fp16"]).all()
    assert torch.equal(sums["fp16"], sums["fp32"])


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_the_precision_record_is_configuration_only(name):
    """What `describe` publishes is the same before and after any course of the loss scale."""
    a = Precision(name)
    before = a.describe()
    if a.scaler is not None:
        a.scaler.overflowed()
        for _ in range(a.scaler.growth_interval + 1):
            a.scaler.clean()
    assert a.describe() == before
