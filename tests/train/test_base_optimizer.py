"""`finetune.optimizer`: the base optimizer the DP optimizer wraps (DP-SAT Table 3: Adam)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dpadapter.data import build_splits
from dpadapter.models import create_model, replace_head
from dpadapter.settings import ConfigError, ModelConfig
from dpadapter.train.dp_fit import FitSettings, dp_fit
from dpadapter.train.dp_spec import run_spec


def _fit(cfg, optimizer: str, lr: float):
    _, roles = build_splits(cfg, ["syn-same"])
    train = roles["syn-same"].train
    spec = dataclasses.replace(run_spec(cfg, "dpsgd", 4.0, len(train)), epochs=1)
    model = replace_head(create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0), 5, 0)
    start = copy.deepcopy(model.state_dict())
    settings = dataclasses.replace(
        FitSettings.from_config(cfg), optimizer=optimizer, lr=lr, momentum=0.0
    )
    algo, ledger = dp_fit(model, train, "dpsgd", spec, settings, 0, max_steps=1)
    deltas = torch.cat([(model.state_dict()[k] - v).flatten() for k, v in start.items()])
    return deltas.abs(), ledger


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_adam_first_step_moves_every_coordinate_by_about_lr(tiny_cfg):
    """Adam's first update is lr * m / (sqrt(v) + eps) = lr * g / (|g| + eps): each coordinate
    moves by lr (bias-corrected), whatever the gradient's scale; SGD's moves are lr * |g|."""
    lr = 1e-3
    adam, ledger = _fit(tiny_cfg, "adam", lr)
    assert ledger.steps == 1
    assert adam.max() <= lr * (1 + 1e-3)  # float32 rounding of w + step - w
    assert adam.median() > 0.99 * lr
    sgd, _ = _fit(tiny_cfg, "sgd", lr)
    assert sgd.median() < 0.5 * lr or sgd.median() > 2 * lr  # not Adam's signature


def test_adam_with_momentum_is_refused(tiny_raw):
    from dpadapter.validation.compose import validate

    raw = copy.deepcopy(tiny_raw)
    raw["finetune"].update(optimizer="adam", momentum=0.9)
    with pytest.raises(ConfigError, match="finetune.momentum: adam"):
        validate(raw)
