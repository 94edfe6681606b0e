"""Fine-tuning strategies: registry, schedules, and what central DP fine-tuning trains."""

import pytest
import torch

from dpadapter.models import create_model, get_head_params
from dpadapter.settings import ModelConfig
from dpadapter.train.strategies import (
    STRATEGIES,
    apply_phase,
    get_strategy,
    released_dims,
    trainable_params,
)


@pytest.fixture
def model():
    return create_model(ModelConfig("cnn-gn", 4, 8), num_classes=5, in_chans=1, seed=0)


def test_registry_and_schedules():
    assert set(STRATEGIES) >= {"ft", "ht", "ut"}
    assert get_strategy("ft").schedule(10).t1 == 0
    assert get_strategy("ht").schedule(10).t1 == 10
    ut = get_strategy("ut").schedule(10, 0.3)
    assert ut.t1 == 3
    assert [ut.phase(s) for s in range(5)] == ["ht", "ht", "ht", "ft", "ft"]
    assert ut.phases() == [
        {"phase": "ht", "start": 0, "steps": 3},
        {"phase": "ft", "start": 3, "steps": 7},
    ]
    assert get_strategy("ut").schedule(10, 0.3, t1=10).phases() == [
        {"phase": "ht", "start": 0, "steps": 10}
    ]
    with pytest.raises(ValueError):
        get_strategy("ft").schedule(10, t1=3)
    with pytest.raises(KeyError):
        get_strategy("lora")


def test_trainable_params_and_freezing(model):
    head = {id(p) for p in get_head_params(model)}
    assert {id(p) for p in trainable_params(model, "ht")} == head
    assert len(trainable_params(model, "ft")) == len(list(model.parameters()))
    kept = apply_phase(model, "ht")
    assert {id(p) for p in kept} == head
    assert all(p.requires_grad == (id(p) in head) for p in model.parameters())
    dims = released_dims(model)
    assert dims["ht"] == sum(p.numel() for p in get_head_params(model))
    assert dims["ft"] == sum(p.numel() for p in model.parameters())
    apply_phase(model, "ft")
    assert all(p.requires_grad for p in model.parameters())


def _fast_spec(cfg, n):
    """One epoch (8 Poisson steps) with the RDP accountant: calibration takes milliseconds."""
    import dataclasses

    from dpadapter.train.dp_spec import run_spec

    return dataclasses.replace(run_spec(cfg, "dpsgd", 2.0, n), epochs=1, accountant="rdp")


def _central(tiny_cfg, strategy, fraction, monkeypatch):
    """Run central DP fine-tuning with `strategy`; record (phase, backbone moved?) per step."""
    from dpadapter.data import build_splits
    from dpadapter.models import replace_head
    from dpadapter.train import dp_fit as fit

    _, roles = build_splits(tiny_cfg, ["syn-shift"])
    data = roles["syn-shift"]
    model = create_model(tiny_cfg.model, 5, 1, seed=0)
    replace_head(model, data.num_classes, 0)
    head = {id(p) for p in get_head_params(model)}
    backbone0 = [p.detach().clone() for p in model.parameters() if id(p) not in head]
    head0 = [p.detach().clone() for p in get_head_params(model)]
    spec = _fast_spec(tiny_cfg, len(data.train))
    schedule = get_strategy(strategy).schedule(spec.total_steps, fraction)
    calls = []
    real = fit.apply_phase

    def spy(m, phase):
        moved = any(
            not torch.equal(p, q)
            for p, q in zip(
                [p for p in model.parameters() if id(p) not in head], backbone0, strict=True
            )
        )
        calls.append((phase, moved))
        return real(m, phase)

    monkeypatch.setattr(fit, "apply_phase", spy)
    algo, ledger = fit.dp_fit(
        model,
        data.train,
        "dpsgd",
        spec,
        fit.FitSettings.from_config(tiny_cfg),
        0,
        schedule=schedule,
    )
    return model, head, backbone0, head0, calls, spec, schedule, algo, ledger


def test_central_ht_trains_and_noises_only_the_head(tiny_cfg, monkeypatch):
    model, head, backbone0, head0, _, spec, _, algo, ledger = _central(
        tiny_cfg, "ht", None, monkeypatch
    )
    backbone = [p for p in model.parameters() if id(p) not in head]
    assert all(torch.equal(p, q) for p, q in zip(backbone, backbone0, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(get_head_params(model), head0, strict=True))
    # the DP optimizer (clipping and noise) saw exactly the head: noise has the head's dimension
    assert {id(p) for p in algo.optimizer.params} == head
    assert all(p.grad is None for p in backbone)
    # accounting is per release, whatever its dimension
    assert ledger.steps == spec.total_steps


def test_central_ut_switches_at_t1(tiny_cfg, monkeypatch):
    model, head, backbone0, _, calls, spec, schedule, algo, ledger = _central(
        tiny_cfg, "ut", 0.25, monkeypatch
    )
    t1 = schedule.t1
    assert 0 < t1 < spec.total_steps
    # calls[0] sets the first phase; calls[k] (k >= 1) comes right after step k
    assert calls[0] == ("ht", False)
    after_step = calls[1:]
    assert len(after_step) == ledger.steps == spec.total_steps
    for k, (phase, moved) in enumerate(after_step, start=1):
        assert phase == ("ht" if k < t1 else "ft"), k
        assert moved == (k > t1), k  # the backbone first moves at step t1 + 1
    assert {id(p) for p in algo.optimizer.params} == {id(p) for p in model.parameters()}


def test_central_default_is_full_finetuning(tiny_cfg):
    """No schedule: every parameter trains, as before the strategies existed."""
    from dpadapter.data import build_splits
    from dpadapter.train import dp_fit as fit

    _, roles = build_splits(tiny_cfg, ["syn-shift"])
    data = roles["syn-shift"]
    model = create_model(tiny_cfg.model, 5, 1, seed=0)
    spec = _fast_spec(tiny_cfg, len(data.train))
    algo, _ = fit.dp_fit(model, data.train, "dpsgd", spec, fit.FitSettings.from_config(tiny_cfg), 0)
    assert len(algo.optimizer.params) == len(list(model.parameters()))
