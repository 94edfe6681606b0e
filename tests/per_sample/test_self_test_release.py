"""The self-test checks what is released, at the size it is released (issue 35, item 5), and
runs the modules in the mode they train in (item 1).

Each test plants a bug the old self-test (per-example norms only, 3 examples, every
parameter-free module in eval, tolerance relative to the whole example's norm) let through.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from torch import nn

from dpadapter.per_sample import PerSampleCheckError, dp_optimizer, rules, wrap_for_dp
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.self_test import run_check

FLAT = ((6,), torch.float32)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _wrong_sums(monkeypatch, only_recomputed: bool) -> None:
    """bk's clipped sum of every Linear weight 50 % too large (the norms stay right); with
    `only_recomputed`, only where per-example gradients were computed but not kept for the
    sum, i.e. at batch sizes where n * weight.numel() exceeds `keep_elements`."""
    right = rules.layer_sums

    def wrong(rec, weights, wanted):
        out = right(rec, weights, wanted)
        w = rec.params.get("weight")
        dropped = rec.strategy == "per-example" and id(w) not in rec.kept
        if w is not None and id(w) in out and (dropped or not only_recomputed):
            out[id(w)] = out[id(w)] * 1.5
        return out

    monkeypatch.setattr(rules, "layer_sums", wrong)


def _keep_at_most(monkeypatch, keep: int) -> None:
    init = BookKeepingModule.__init__
    monkeypatch.setattr(
        BookKeepingModule,
        "__init__",
        lambda self, module, **kw: init(self, module, **{**kw, "keep_elements": keep}),
    )


def test_a_wrong_clipped_sum_is_refused_naming_the_module(monkeypatch):
    # nothing kept: the MLP's flat layers take the exact norm and the rules' sums, where a kept
    # outer product's sum comes from the arena (the next test plants its bug there)
    _keep_at_most(monkeypatch, 0)
    assert wrap_for_dp(_mlp(), "bk", sample=FLAT).per_sample_check["sum_error"] < 1e-5
    _wrong_sums(monkeypatch, only_recomputed=False)
    with pytest.raises(PerSampleCheckError, match=r"clipped sums .* at module '(0|2)' \(Linear\)"):
        wrap_for_dp(_mlp(), "bk", sample=FLAT)


def test_a_wrong_sum_of_the_kept_gradients_is_refused(monkeypatch):
    """The kept per-example gradients' sums come from one product over their arena
    (`per_sample.arena`), not from the layers' rules: a bug there is caught too."""
    from dpadapter.per_sample import arena

    def model():  # Linear(6, 8) on 4 positions: per-example gradients, kept
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3))

    sample = ((4, 6), torch.float32)
    assert wrap_for_dp(model(), "bk", sample=sample).per_sample_check["passed"]
    right = arena.Arena.sums
    monkeypatch.setattr(
        arena.Arena, "sums", lambda self, w: {k: v * 1.5 for k, v in right(self, w).items()}
    )
    with pytest.raises(PerSampleCheckError, match=r"clipped sums .* at module '0' \(Linear\)"):
        wrap_for_dp(model(), "bk", sample=sample)


def test_the_paths_of_the_physical_batch_size_are_the_ones_checked(monkeypatch):
    """A bug on the path only large batches take: caught at the batch size training uses."""
    _wrong_sums(monkeypatch, only_recomputed=True)
    # per-example gradients of Linear(6, 8) kept up to 8 examples, not beyond
    _keep_at_most(monkeypatch, 48 * 8)

    def model():  # Linear(6, 8) on 4 positions: its per-example gradients are computed
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3))

    sample = ((4, 6), torch.float32)
    rec = wrap_for_dp(model(), "bk", sample=sample, check_batch=4).per_sample_check
    assert rec["passed"] and rec["examples"] == 4  # small batches keep: the bug never runs
    with pytest.raises(PerSampleCheckError, match=r"clipped sums .* at module '0' \(Linear\)"):
        wrap_for_dp(model(), "bk", sample=sample, check_batch=32)


def test_dp_fit_checks_at_the_configured_physical_batch_size(monkeypatch, tiny_cfg):
    from dpadapter.data import build_splits
    from dpadapter.models import create_model, replace_head
    from dpadapter.settings import ModelConfig
    from dpadapter.train.dp_fit import FitSettings, dp_fit
    from dpadapter.train.dp_spec import run_spec

    train = build_splits(tiny_cfg, ["syn-same"])[1]["syn-same"].train
    spec = dataclasses.replace(run_spec(tiny_cfg, "dpsgd", 2.0, len(train)), epochs=1)
    settings = dataclasses.replace(FitSettings.from_config(tiny_cfg), physical_batch_size=24)

    def model():
        return replace_head(create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0), 5, 0)

    algo, _ = dp_fit(model(), train, "dpsgd", spec, settings, 0, max_steps=1)
    assert algo.per_sample_check["examples"] == 24 and algo.per_sample_check["passed"]
    _wrong_sums(monkeypatch, only_recomputed=False)
    with pytest.raises(PerSampleCheckError):
        dp_fit(model(), train, "dpsgd", spec, settings, 0, max_steps=1)


class Shift(nn.Module):
    """Adds `scale * b`: its gradient is `scale` times the output's, a tiny share of the norm."""

    def __init__(self, d: int, scale: float):
        super().__init__()
        self.scale = scale
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x + self.scale * self.b


def test_a_module_with_a_tiny_share_of_the_norm_is_judged_against_its_own(monkeypatch):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), Shift(4, 1e-4), nn.Linear(4, 3))

    def sampler(factor):
        return lambda layer, a, g: {layer.b: factor * layer.scale * g}

    monkeypatch.setitem(GradSampleModule.GRAD_SAMPLERS, Shift, sampler(1.0))
    assert wrap_for_dp(model(), "hooks", sample=FLAT).per_sample_check["passed"]
    monkeypatch.setitem(GradSampleModule.GRAD_SAMPLERS, Shift, sampler(1.5))  # 50 % off
    with pytest.raises(PerSampleCheckError, match=r"module '2' \(Shift\)"):
        wrap_for_dp(model(), "hooks", sample=FLAT)


class TrainingBatchMean(nn.Module):
    """Parameter-free; subtracts the batch mean in training mode only."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.training else x


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_the_self_test_runs_parameter_free_modules_in_training_mode(mode):
    """Called on its own (wrap_for_dp's independence check would refuse first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), TrainingBatchMean(), nn.Tanh(), nn.Linear(8, 3))

    def wrap():
        return BookKeepingModule(model) if mode == "bk" else GradSampleModule(model)

    with pytest.raises(PerSampleCheckError):
        run_check(model, wrap, dp_optimizer, mode, (6,), examples=8)


@pytest.mark.parametrize("mode", ["bk", "hooks", "functorch", "ew"])
def test_dropout_is_compared_in_eval_mode_and_named(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3))
    torch.manual_seed(1)
    rng = torch.get_rng_state()
    rec = wrap_for_dp(model, mode, sample=FLAT).per_sample_check
    assert rec["passed"] and rec["eval_in_check"] == ["1"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for m in model.modules())  # modes as they were
