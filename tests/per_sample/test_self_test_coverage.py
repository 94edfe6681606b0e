"""The self-test covers every parameter the run will train, at two batch sizes, and a run
without it says so in its table (issue 45, item 2)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from dpadapter.models import create_model, replace_head
from dpadapter.per_sample import PerSampleCheckError, rules, wrap_for_dp
from dpadapter.per_sample.self_test import SMALL
from dpadapter.settings import ModelConfig
from dpadapter.train.dp_fit import FitSettings
from dpadapter.train.strategies import every_phase_trains, get_strategy

SAMPLE = ((1, 28, 28), torch.float32)


def _wrong_groupnorm(monkeypatch):
    right = rules.group_norm_folded  # the per-example kernel, fused or not (`norm_fusion`)

    def wrong(module, a, *rest):
        dx, gw, gb = right(module, a, *rest)
        return dx, gw * 1.5, gb  # a backbone GroupNorm's per-example gradient 50 % too large

    monkeypatch.setattr(rules, "group_norm_folded", wrong)


def _fit(tiny_cfg, strategy: str, t1_fraction: float | None):
    from dpadapter.data import build_splits
    from dpadapter.train.dp_fit import dp_fit
    from dpadapter.train.dp_spec import run_spec

    train = build_splits(tiny_cfg, ["syn-same"])[1]["syn-same"].train
    spec = dataclasses.replace(run_spec(tiny_cfg, "dpsgd", 2.0, len(train)), epochs=1)
    model = replace_head(create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0), 5, 0)
    schedule = get_strategy(strategy).schedule(spec.total_steps, t1_fraction)
    settings = FitSettings.from_config(tiny_cfg)
    return dp_fit(model, train, "dpsgd", spec, settings, 0, max_steps=2, schedule=schedule)


def test_unified_tuning_is_checked_on_the_backbone_it_trains_after_t1(tiny_cfg, monkeypatch):
    """UT starts on the head: checked at its first phase only, a wrong backbone norm passed."""
    _fit(tiny_cfg, "ht", None)  # head tuning never trains the GroupNorms: nothing to refuse
    _wrong_groupnorm(monkeypatch)
    _fit(tiny_cfg, "ht", None)
    with pytest.raises(PerSampleCheckError, match=r"\(GroupNorm\)"):
        _fit(tiny_cfg, "ut", 0.5)


def test_the_union_of_phases_is_restored_after_the_checks():
    model = replace_head(create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0), 5, 0)
    schedule = get_strategy("ut").schedule(10, 0.5)
    head = {id(p) for p in model.get_classifier().parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in head)
    with every_phase_trains(model, schedule):
        assert all(p.requires_grad for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == [
        id(p) in head for p in model.parameters()
    ]


def test_the_self_test_runs_at_the_physical_and_a_small_odd_size(monkeypatch):
    model = create_model(ModelConfig("cnn-gn", 4, 8), 10, 1, seed=0)
    record = wrap_for_dp(copy.deepcopy(model), "bk", sample=SAMPLE, check_batch=12)
    assert record.per_sample_check["examples"] == 12
    assert record.per_sample_check["also_at"]["examples"] == SMALL
    assert record.per_sample_check["also_at"]["passed"] is True
    # a rule wrong only at small batches is caught at the small size
    right = rules.group_norm_folded  # the per-example kernel, fused or not (`norm_fusion`)

    def wrong_when_small(module, a, *rest):
        dx, gw, gb = right(module, a, *rest)
        return dx, (gw * 1.5 if a.shape[0] <= SMALL else gw), gb

    monkeypatch.setattr(rules, "group_norm_folded", wrong_when_small)
    with pytest.raises(PerSampleCheckError, match=r"\(GroupNorm\)"):
        wrap_for_dp(copy.deepcopy(model), "bk", sample=SAMPLE, check_batch=12)


def test_a_table_of_unverified_jobs_says_so(tmp_path):
    from dpadapter.stages import aggregate

    paths = []
    for seed, verified in ((0, True), (1, False)):
        m = {
            "wildcards": {"upstream": "standard", "task": "t", "algo": "dpsgd", "eps": "1",
                          "seed": str(seed)},
            "test_accuracy": 0.5, "test_robust_accuracy": 0.4, "privacy": {"epsilon": 0.9},
            "per_sample_check": {"passed": True} if verified else {"verified": False},
        }  # fmt: skip
        p = tmp_path / f"m{seed}.json"
        p.write_text(json.dumps(m))
        paths.append(p)
    aggregate.run(paths, [], ["standard"], tmp_path / "f.csv", tmp_path / "f.md")
    md = (tmp_path / "f.md").read_text()
    assert "Per-example clipping unverified** in 1 of 2 jobs" in md
    assert "standard/t/dpsgd/eps1/seed1" in md and "seed0" not in md.split("unverified**")[1]
    aggregate.run(paths[:1], [], ["standard"], tmp_path / "f.csv", tmp_path / "g.md")
    assert "unverified" not in (tmp_path / "g.md").read_text()


def test_nn_module_default_state_is_not_a_tensor_attribute():
    """The state check's list of nn.Module internals leaves no tensor out (a sanity check)."""
    from dpadapter.per_sample.module_state import snapshot_attributes

    lin = nn.Linear(2, 2)
    assert snapshot_attributes(lin) == {lin: {}}
    lin.kept = torch.ones(2)
    assert list(snapshot_attributes(lin)[lin]) == ["kept"]
