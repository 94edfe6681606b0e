"""Privacy-correctness suite, parametrized over every registered algorithm (present and future).

A new algorithm gets all of it by registering; what it must provide is an honest
`describe_release` (audited signal and noise of each Gaussian query it answers) and, if its
non-private limit is not plain SGD, an entry in NONPRIVATE below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import algo_harness as H
import privacy_checks as C
import pytest
import torch
from torch import nn

from dpadapter.algorithms import ALGORITHMS
from dpadapter.privacy import pld_epsilon
from dpadapter.settings import FinetuneConfig
from dpadapter.train import dp_fit as fit
from dpadapter.train.dp_spec import run_spec

NAMES = sorted(ALGORITHMS)
# The default per-sample mode and an Opacus one (GEP runs hooks under bk: the same run twice).
MODES = [FinetuneConfig().grad_sample_mode, "hooks"]


@pytest.fixture(params=MODES)
def mode(request, monkeypatch) -> str:
    monkeypatch.setattr(H, "MODE", request.param)
    return request.param


def test_the_suite_runs_the_default_mode():
    assert MODES[0] == "bk"


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("name", NAMES)
def test_each_example_contribution_is_within_the_declared_sensitivity(name, algo_data, mode):
    C.check_sensitivity(ALGORITHMS[name], algo_data)


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
@pytest.mark.parametrize("name", NAMES)
def test_noise_has_the_configured_std_and_the_ledger_records_its_joint_sigma(name, algo_data, mode):
    C.check_noise(ALGORITHMS[name], algo_data)


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_restored_before_the_update_with_virtual_batches(name, algo_data, mode):
    C.check_restores_weights(ALGORITHMS[name], algo_data)


@pytest.mark.parametrize("name", NAMES)
def test_virtual_batches_give_the_same_update(name, algo_data, mode):
    C.check_virtual_batches(ALGORITHMS[name], algo_data)


# --- sigma 0 and no clipping: the non-private optimizer ---------------------------------------
def _grad(model: nn.Module, x, y) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    H.LOSS(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _shift(model: nn.Module, d: list[torch.Tensor], alpha: float) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), d, strict=True):
            p.add_(v, alpha=alpha)


def _norm(d: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((v * v).sum() for v in d)))


def sgd_steps(model, opt, batches, params) -> None:
    for x, y in batches:
        g = _grad(model, x, y)
        for p, v in zip(model.parameters(), g, strict=True):
            p.grad = v
        opt.step()


def sam_steps(model, opt, batches, params) -> None:
    """Foret et al.'s SAM: gradient at w + rho g/||g|| on the same batch, applied at w."""
    for x, y in batches:
        g = _grad(model, x, y)
        e = params["rho"] / _norm(g)
        _shift(model, g, e)
        g2 = _grad(model, x, y)
        _shift(model, g, -e)
        for p, v in zip(model.parameters(), g2, strict=True):
            p.grad = v
        opt.step()


def sat_steps(model, opt, batches, params, beta: float | None = None) -> None:
    """Ascent along the previous step's gradient (or its momentum sum), applied at w."""
    d = None
    for x, y in batches:
        if d is not None:
            _shift(model, d, params["rho"] / _norm(d))
        g = _grad(model, x, y)
        if d is not None:
            _shift(model, d, -params["rho"] / _norm(d))
        for p, v in zip(model.parameters(), g, strict=True):
            p.grad = v
        opt.step()
        if d is None or beta is None:
            d = g
        else:
            d = [beta * m + v for m, v in zip(d, g, strict=True)]


MOMENTUM = 0.9
NONPRIVATE: dict[str, Callable] = {
    "dpsam": sam_steps,
    "dpsat": sat_steps,
    "dpsat-momentum": lambda m, o, b, p: sat_steps(m, o, b, p, beta=p["beta"] or MOMENTUM),
}


@pytest.mark.parametrize("name", NAMES)
def test_sigma_zero_and_no_clipping_is_the_nonprivate_optimizer(name, algo_data):
    n = 12
    s = H.spec(max_grad_norm=1e6, expected_batch_size=n)
    run = H.build(name, s, public=algo_data.public, sigma=0.0, lr=0.5, momentum=MOMENTUM)
    plain = H.tiny_model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=MOMENTUM)
    x, y = algo_data.private.tensors
    batches = [(x[:n], y[:n]), (x[n : 2 * n], y[n : 2 * n])]
    for b in batches:
        H.logical_step(run, *b)
    NONPRIVATE.get(name, sgd_steps)(plain, opt, batches, run.algo.params)
    for a, b in zip(run.params, plain.parameters(), strict=True):
        assert torch.allclose(a, b.detach(), atol=1e-6, rtol=1e-4), float((a - b).abs().max())


# --- resume: state_dict carries everything ------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resumes_to_the_same_run(name, algo_data):
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12)
    x, y = algo_data.private.tensors
    batches = [(x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12]) for t in range(4)]
    kw = dict(public=algo_data.public, sigma=0.7, lr=0.3, momentum=0.9, audit=False)
    full = H.build(name, s, **kw)
    for b in batches:
        H.logical_step(full, *b, physical=5)
    first = H.build(name, s, **kw)
    for b in batches[:2]:
        H.logical_step(first, *b, physical=5)
    state = H.snapshot(first)
    resumed = H.build(name, s, **kw, model=H.tiny_model(seed=7))
    H.restore(resumed, state)
    for b in batches[2:]:
        H.logical_step(resumed, *b, physical=5)
    assert resumed.ledger.history == full.ledger.history
    for a, b in zip(full.params, resumed.params, strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())


# --- the real stage: Poisson batches, virtual batches, calibration, epsilon -----------------
@pytest.fixture(scope="session")
def sigma_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("calibration") / "sigma.json")


@pytest.mark.parametrize("name", NAMES)
def test_stage_run_spends_at_most_the_target_on_poisson_batches(
    name, tiny_cfg, algo_data, sigma_cache, monkeypatch
):
    """The real stage loop (Poisson loader, BatchMemoryManager, the config's PRV accountant)."""
    eps = 2.0
    cfg = dataclasses.replace(
        tiny_cfg,
        finetune=dataclasses.replace(tiny_cfg.finetune, physical_batch_size=16),
    )
    train = algo_data.private
    spec = dataclasses.replace(run_spec(cfg, name, eps, len(train)), calibration_cache=sigma_cache)
    logical: list[int] = []
    open_batch = [0]
    base = ALGORITHMS[name]

    class Observed(base):  # the stage as it should be, plus a record of logical batch sizes
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if self.needs_public_data:
                self.set_public_data(algo_data.public)

        def train_step(self, model, x, y, loss_fn):
            before = self.ledger.steps
            out = super().train_step(model, x, y, loss_fn)
            open_batch[0] += len(y)
            assert len(y) <= 16, "physical batches exceed physical_batch_size"
            if self.ledger.steps > before:
                assert self.ledger.steps == before + 1, "more than one record per step"
                logical.append(open_batch[0])
                open_batch[0] = 0
            return out

    monkeypatch.setitem(fit.ALGORITHMS, name, Observed)
    epochs: list[dict] = []
    algo, ledger = fit.dp_fit(
        H.tiny_model(),
        train,
        name,
        spec,
        fit.FitSettings.from_config(cfg),
        0,
        public=algo_data.public,
        on_epoch=lambda e, st: epochs.append(st),
    )

    # every Poisson batch (empty ones too) is one release at the accountant's sampling rate
    assert ledger.steps == spec.total_steps == len(logical)
    assert all(seg.sample_rate == spec.sample_rate for seg in ledger.history)
    n, q, t = len(train), spec.sample_rate, len(logical)
    assert len(set(logical)) > 1, "batch sizes do not vary: not Poisson sampling"
    mean = sum(logical) / t
    assert abs(mean - q * n) < 4 * math.sqrt(n * q * (1 - q) / t)
    # the reported epsilon: within the target, and an upper bound on an independent PLD value
    reported = epochs[-1]["epsilon_spent"]  # the stage's ledger.epsilon() after the last step
    assert epochs[-1]["steps"] == ledger.steps
    pld = pld_epsilon(ledger.history, spec.delta, discretization=1e-3)  # pessimistic: larger
    assert reported <= eps * (1 + 1e-9)
    assert reported >= pld * (1 - 0.01), (reported, pld)
    assert reported >= 0.97 * eps, "calibration wastes budget"
    assert ledger.history[0].noise_multiplier == pytest.approx(algo.noise_multiplier(0), rel=1e-12)


# --- the trained parameter set may change between logical batches (UT strategy) --------------
@pytest.mark.parametrize("name", NAMES)
def test_trained_parameters_may_change_between_logical_batches(name, algo_data):
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12)
    run = H.build(name, s, public=algo_data.public, sigma=0.5, lr=0.3, momentum=0.9)
    head = {id(p) for p in run.model.get_classifier().parameters()}
    x, y = algo_data.private.tensors
    frozen_before = [p.detach().clone() for p in run.model.parameters() if id(p) not in head]
    for t, phase in enumerate(["ht", "ht", "ft", "ft", "ht"]):
        for p in run.model.parameters():
            p.requires_grad_(phase == "ft" or id(p) in head)
        H.logical_step(run, x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12], physical=5)
        if t == 1:  # head-tuning steps leave the backbone exactly as it was
            backbone = [p for p in run.model.parameters() if id(p) not in head]
            assert all(torch.equal(a, b) for a, b in zip(frozen_before, backbone, strict=True))
    assert run.ledger.steps == 5
    for step in run.algo.audit:
        assert step.recorded_noise_multiplier == pytest.approx(step.joint_noise_multiplier)
