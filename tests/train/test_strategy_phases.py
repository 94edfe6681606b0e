"""Every registered strategy: which parameters each phase trains, how large a release is, and
that a DP step (every per-sample mode) moves exactly those parameters (federated: in
tests/federated/test_bitfit_federated.py)."""

import dataclasses

import pytest
import torch

from dpadapter.models import create_model, get_head_params
from dpadapter.per_sample import GRAD_SAMPLE_MODES
from dpadapter.settings import ModelConfig
from dpadapter.train.strategies import (
    BITFIT,
    FT,
    HT,
    STRATEGIES,
    Schedule,
    apply_phase,
    get_strategy,
    released_dim,
    released_dims,
    trainable_params,
)


def _model():
    # cnn-gn width 8: convs 1->4->8->16 (with biases), GroupNorms, head 16->5
    return create_model(ModelConfig("cnn-gn", 4, 8), num_classes=5, in_chans=1, seed=0)


def _expected_names(model, phase: str) -> set[str]:
    """Written out independently of the registry's selectors."""
    head = {id(p) for p in get_head_params(model)}
    names = dict(model.named_parameters())
    if phase == HT:
        return {n for n, p in names.items() if id(p) in head}
    if phase == FT:
        return set(names)
    if phase == BITFIT:
        return {n for n, p in names.items() if id(p) in head or n.split(".")[-1] == "bias"}
    raise AssertionError(f"a phase without a test: {phase}")


# p + n, n and biases + n of _model(), counted by hand:
# conv 1->4: 36 + 4, GN 4 + 4; conv 4->8: 288 + 8, GN 8 + 8; conv 8->16: 1152 + 16, GN 16 + 16;
# head 16 * 5 + 5 = 85. Biases: conv 4 + 8 + 16, GN 4 + 8 + 16.
DIMS = {FT: 1645, HT: 85, BITFIT: 141}
STRATEGY_PHASES = {"ft": (FT,), "ht": (HT,), "ut": (HT, FT), "bitfit": (BITFIT,)}


def test_every_strategy_is_tested_here():
    assert set(STRATEGIES) == set(STRATEGY_PHASES)
    for name, phases in STRATEGY_PHASES.items():
        assert get_strategy(name).phases == phases


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_phase_parameters_and_released_dims(name):
    model = _model()
    by_id = {id(p): n for n, p in model.named_parameters()}
    strat = get_strategy(name)
    for phase in strat.phases:
        got = {by_id[id(p)] for p in trainable_params(model, name, phase)}
        assert got == _expected_names(model, phase)
        assert released_dim(model, phase) == DIMS[phase]
        kept = apply_phase(model, phase)
        assert {by_id[id(p)] for p in kept} == got
        assert {n for n, p in model.named_parameters() if p.requires_grad} == got
    if len(strat.phases) == 1:
        assert trainable_params(model, name) == trainable_params(model, name, strat.phases[0])
    else:
        with pytest.raises(ValueError, match="two phases"):
            trainable_params(model, name)
    # the default dims are HT's and FT's only (metrics.json of ft/ht/ut keeps its keys)
    assert released_dims(model) == {HT: 85, FT: 1645}
    assert released_dims(model, (HT, FT, BITFIT)) == DIMS


def test_bitfit_schedule_is_one_phase():
    s = get_strategy("bitfit").schedule(7)
    assert (s.t1, s.first, s.then) == (0, BITFIT, BITFIT)
    assert {s.phase(k) for k in range(9)} == {BITFIT}
    assert s.phases() == [{"phase": BITFIT, "start": 0, "steps": 7}]
    with pytest.raises(ValueError):
        get_strategy("bitfit").schedule(7, t1=3)  # only ut takes a T1
    with pytest.raises(ValueError, match="unknown phase"):
        Schedule("x", 3, 0, "lora", FT)


def test_existing_schedules_unchanged():
    """ft/ht/ut: T1, each step's phase and metrics.json's phases as before the generalisation."""
    cases = {("ft", None): 0, ("ht", None): 8, ("ut", 0.25): 2, ("ut", 0.0): 0, ("ut", 1.0): 8}
    for (name, frac), t1 in cases.items():
        s = get_strategy(name).schedule(8, frac)
        assert s.t1 == t1
        want_phase = [HT if k < t1 or t1 == 8 else FT for k in range(10)]
        assert [s.phase(k) for k in range(10)] == want_phase
        want = [{"phase": HT, "start": 0, "steps": t1}] if t1 else []
        want += [{"phase": FT, "start": t1, "steps": 8 - t1}] if t1 < 8 else []
        assert s.phases() == want


def _phase_fit(tiny_cfg, phase: str, mode: str):
    from dpadapter.data import build_splits
    from dpadapter.models import replace_head
    from dpadapter.train import dp_fit as fit
    from dpadapter.train.dp_spec import run_spec

    _, roles = build_splits(tiny_cfg, ["syn-shift"])
    data = roles["syn-shift"]
    model = create_model(tiny_cfg.model, 5, 1, seed=0)
    replace_head(model, data.num_classes, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = dataclasses.replace(
        run_spec(tiny_cfg, "dpsgd", 2.0, len(data.train)), epochs=1, accountant="rdp"
    )
    settings = dataclasses.replace(fit.FitSettings.from_config(tiny_cfg), grad_sample_mode=mode)
    schedule = Schedule("test", spec.total_steps, 0, phase, phase)
    algo, ledger = fit.dp_fit(
        model, data.train, "dpsgd", spec, settings, 0, schedule=schedule, max_steps=2
    )
    assert ledger.steps == 2
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    return model, moved, algo


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("phase", [HT, FT, BITFIT])
def test_dp_steps_move_exactly_the_phase_parameters(tiny_cfg, phase, mode):
    model, moved, algo = _phase_fit(tiny_cfg, phase, mode)
    want = _expected_names(model, phase)
    assert moved == want
    # what was clipped and noised: the phase's parameters only (the release's dimension)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert {by_id[id(p)] for p in algo.optimizer.params} == want
    assert sum(p.numel() for p in algo.optimizer.params) == released_dim(model, phase)
