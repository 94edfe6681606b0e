"""The properties of Algorithm 1 (and of the SAM baseline) that the results rely on."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from upstream_helpers import (
    ForwardRecorder,
    context,
    decode,
    indexed_data,
    params_of,
    small_model,
)

from dpadapter.settings import SGDConfig
from dpadapter.train.loops import make_sgd, sgd_train, standard_step
from dpadapter.upstream import UPSTREAMS
from dpadapter.upstream.dpadapter import EMAPerturbedStep, relative_step_cost
from dpadapter.upstream.perturbed import (
    B1Sampler,
    PerturbedStep,
    batch_gradient,
    global_norm,
)


def _dpadapter(**kw):
    base = {
        "epochs": 1,
        "lr": 0.05,
        "milestones": [],
        "m1": 64,
        "m2": 16,
        "eta1": 1.0,
        "gamma": 0.5,
        "chunk_size": 24,
    }
    return UPSTREAMS["dpadapter"]({**base, **kw})


def _sam(**kw):
    base = {
        "epochs": 1,
        "lr": 0.05,
        "milestones": [],
        "m": 16,
        "eta1": 1.0,
        "gamma": 0.5,
        "chunk_size": 1000,
    }
    return UPSTREAMS["sam"]({**base, **kw})


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_registered_beside_the_baselines_with_paper_defaults():
    assert {"scratch", "standard", "sam", "dpadapter"} <= set(UPSTREAMS)
    dp = UPSTREAMS["dpadapter"].default_params()
    assert (dp["m1"], dp["m2"], dp["eta1"], dp["gamma"]) == (5000, 50, 1.0, 2.0)
    assert (dp["epochs"], dp["lr"], dp["milestones"]) == (1000, 0.1, [500, 750])
    assert (dp["momentum"], dp["weight_decay"], dp["refresh_every"]) == (0.9, 1e-4, 1)
    sam = UPSTREAMS["sam"].default_params()
    assert (sam["m"], sam["gamma"]) == (100, 1.0) and "refresh_every" not in sam
    for name in ("sam", "dpadapter"):
        assert UPSTREAMS[name].needs_warmup and UPSTREAMS[name].needs_public_data
    with pytest.raises(ValueError, match="m3: unknown parameter"):
        UPSTREAMS["dpadapter"]({"m3": 1})


@pytest.mark.parametrize(
    ("weight_decay", "gamma", "eta1"),
    # gamma = 0 takes the shortcut that skips the B1 pass; eta1 = 0 with gamma > 0 goes through
    # the full perturb-restore path with a Delta that happens to be zero.
    [(0.0, 0.0, 5.0), (5e-4, 0.0, 5.0), (5e-4, 0.5, 0.0)],
)
def test_zero_perturbation_is_standard_training_step_for_step(
    weight_decay, gamma, eta1, monkeypatch
):
    data = indexed_data(96)
    warm = small_model()
    reference = copy.deepcopy(warm)
    cfg = SGDConfig(
        epochs=2,
        batch_size=16,
        lr=0.05,
        momentum=0.9,
        weight_decay=weight_decay,
        milestones=(1,),
        lr_gamma=0.1,
    )
    seen_ref: list[list[torch.Tensor]] = []
    seen_dp: list[list[torch.Tensor]] = []
    logged: list[dict] = []

    def ref_step(model, opt, x, y):
        loss = standard_step(model, opt, x, y)
        seen_ref.append(params_of(model))
        return loss

    sgd_train(reference, data, cfg, seed=3, step=ref_step)

    method = _dpadapter(epochs=2, milestones=[1], weight_decay=weight_decay, gamma=gamma, eta1=eta1)
    original = PerturbedStep.__call__

    def spy(self, model, opt, x, y):
        loss = original(self, model, opt, x, y)
        seen_dp.append(params_of(model))
        return loss

    with monkeypatch.context() as mp:
        mp.setattr(PerturbedStep, "__call__", spy)
        model = method.build(context(data, warm, lambda e, s: logged.append(s), seed=3))
    assert len(seen_dp) == len(seen_ref) == 12
    for k, (a, b) in enumerate(zip(seen_dp, seen_ref, strict=True)):
        assert _equal(a, b), f"step {k} differs from standard training"
    assert _equal(params_of(model), params_of(reference))
    assert all(s["delta_norm"] == 0.0 for s in logged) and ("b1_loss" in logged[0]) == (gamma > 0)
    # Able to fail: the same run with a non-zero radius leaves the standard trajectory.
    other = _dpadapter(epochs=2, milestones=[1], weight_decay=weight_decay, gamma=0.5, eta1=5.0)
    moved = other.build(context(data, warm, lambda e, s: None, seed=3))
    assert not _equal(params_of(moved), params_of(reference))


@pytest.mark.parametrize("make", [_dpadapter, _sam])
def test_perturbation_is_fully_reverted(make):
    """lr = 0 and weight decay = 0: whatever Delta did during the step must leave no trace."""
    data = indexed_data(80)
    warm = small_model()
    before = params_of(warm)
    method = make(lr=0.0, weight_decay=0.0, momentum=0.9, eta1=10.0, gamma=1.0)
    model, step = method.train(copy.deepcopy(warm), context(data, warm, lambda e, s: None))
    assert step.steps == 5
    assert step.last_delta is not None and global_norm(step.last_delta) == pytest.approx(1.0)
    assert _equal(params_of(model), before)


def _applied_perturbations(step: PerturbedStep, model: nn.Module, data, n_steps: int, lr=0.0):
    """Delta as seen by the update forward pass (the last forward of each step)."""
    opt, _ = make_sgd(model, SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0))
    rec = ForwardRecorder(model, snapshot_params=True)
    x_all, y_all = data.tensors
    out = []
    try:
        for k in range(n_steps):
            theta = params_of(model)
            rec.clear()
            step(model, opt, x_all[16 * k : 16 * k + 16], y_all[16 * k : 16 * k + 16])
            out.append([p - t for p, t in zip(rec.params[-1], theta, strict=True)])
    finally:
        rec.remove()
    return out


def test_delta_norm_never_exceeds_gamma():
    data = indexed_data(128)
    model = small_model()
    gamma = 0.3
    step = PerturbedStep(
        data, eta1=50.0, gamma=gamma, chunk_size=40, sampler=B1Sampler(len(data), 100, seed=0)
    )
    deltas = _applied_perturbations(step, model, data, 4, lr=0.05)
    for d in deltas:
        assert global_norm(d) <= gamma * (1 + 1e-5)
        assert global_norm(d) == pytest.approx(gamma, rel=1e-4)  # eta1 is large: the cap binds
    stats = step.pop_epoch_stats()
    assert stats["gamma_binding"] == 1.0 and stats["delta_norm_raw"] > gamma


def test_unclipped_delta_is_eta1_times_the_b1_gradient():
    data = indexed_data(128)
    model = small_model()
    eta1 = 0.7
    step = PerturbedStep(
        data, eta1=eta1, gamma=1e6, chunk_size=30, sampler=B1Sampler(len(data), 100, seed=1)
    )
    reference = copy.deepcopy(model)
    (delta,) = _applied_perturbations(step, model, data, 1)
    assert step.last_b1 is not None
    x, y = data.tensors
    loss = nn.functional.cross_entropy(reference(x[step.last_b1]), y[step.last_b1])
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    for d, g in zip(delta, grads, strict=True):
        torch.testing.assert_close(d, eta1 * g, rtol=1e-4, atol=1e-6)
    assert step.pop_epoch_stats()["gamma_binding"] == 0.0


def test_chunked_b1_gradient_equals_full_batch_gradient():
    data = indexed_data(100)
    model = small_model()
    x, y = data.tensors
    idx = torch.randperm(100, generator=torch.Generator().manual_seed(0))[:77]
    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
    full = torch.autograd.grad(loss, list(model.parameters()))
    for chunk in (1, 7, 32, 77, 500):
        grads, mean_loss = batch_gradient(model, x, y, chunk, index=idx)
        assert mean_loss == pytest.approx(float(loss.detach()), rel=1e-5)
        for a, b in zip(grads, full, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # optimizer buffers untouched


def test_chunking_bounds_the_forward_batch():
    data = indexed_data(100)
    model = small_model()
    rec = ForwardRecorder(model)
    x, y = data.tensors
    batch_gradient(model, x, y, 16, index=torch.arange(90))
    rec.remove()
    assert max(len(i) for i in rec.inputs) == 16 and sum(len(i) for i in rec.inputs) == 90


def _record_batches(method, data, monkeypatch, seed=0):
    """(B1 indices, B2 indices) per step, read off the model's inputs."""
    warm = small_model()
    model = copy.deepcopy(warm)
    rec = ForwardRecorder(model)
    steps: list[tuple[list[int], list[int]]] = []
    original = PerturbedStep.__call__

    def spy(self, m, opt, x, y):
        rec.clear()
        loss = original(self, m, opt, x, y)
        b1 = [i for inp in rec.inputs[:-1] for i in decode(inp)]
        steps.append((b1, decode(rec.inputs[-1])))
        assert decode(rec.inputs[-1]) == decode(x)  # the last forward is the update on B2
        return loss

    with monkeypatch.context() as mp:
        mp.setattr(PerturbedStep, "__call__", spy)
        method.train(model, context(data, warm, lambda e, st: None, seed=seed))
    rec.remove()
    return steps


def test_b1_and_b2_are_independent_draws(monkeypatch):
    n, m1, m2 = 200, 60, 10
    data = indexed_data(n)
    steps = _record_batches(_dpadapter(m1=m1, m2=m2, epochs=2, lr=0.01), data, monkeypatch)
    assert len(steps) == 2 * n // m2
    overlaps = []
    for b1, b2 in steps:
        assert len(b1) == len(set(b1)) == m1  # B1: m1 distinct examples
        assert len(b2) == m2
        assert not set(b2) <= set(b1)  # B2 is not carved out of B1
        overlaps.append(len(set(b1) & set(b2)))
    # B1 is redrawn every step and uniform over the whole set, not a fixed or sliding subset.
    assert all(a[0] != b[0] for a, b in zip(steps, steps[1:], strict=False))
    assert len({i for b1, _ in steps for i in b1}) == n
    # Each epoch B2 walks a permutation of the data (standard shuffling).
    first_epoch = [i for _, b2 in steps[: n // m2] for i in b2]
    assert sorted(first_epoch) == list(range(n))
    # Independent uniform draws overlap by m1 * m2 / n on average (3 here); nested draws would
    # give m2, disjoint ones 0.
    mean = sum(overlaps) / len(overlaps)
    expected = m1 * m2 / n
    assert abs(mean - expected) < 4 * math.sqrt(expected * (1 - m1 / n) / len(overlaps)) + 0.2
    # B1 comes from its own sampler: changing the B2 batch size leaves the B1 sequence unchanged,
    # and its generator is not seeded like the B2 loader's.
    for seed in (0, 1, 7):
        assert B1Sampler(n, m1, seed).generator.initial_seed() != seed
    other = _record_batches(_dpadapter(m1=m1, m2=20, epochs=1, lr=0.01), data, monkeypatch)
    assert [b1 for b1, _ in other] == [b1 for b1, _ in steps[: len(other)]]


def test_sam_perturbs_and_updates_on_the_same_batch(monkeypatch):
    data = indexed_data(96)
    steps = _record_batches(_sam(m=16, chunk_size=5), data, monkeypatch)
    assert len(steps) == 6
    for b1, b2 in steps:
        assert b1 == b2 and len(b1) == 16


def test_refresh_every_reuses_delta_between_refreshes():
    data = indexed_data(160)
    model = small_model()
    step = PerturbedStep(
        data,
        eta1=1.0,
        gamma=0.2,
        chunk_size=64,
        refresh_every=3,
        sampler=B1Sampler(len(data), 64, seed=0),
    )
    opt, _ = make_sgd(model, SGDConfig(lr=0.05, momentum=0.9, weight_decay=0.0))
    x, y = data.tensors
    draws, deltas = [], []
    for k in range(7):
        step(model, opt, x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16])
        draws.append(step.last_b1)
        deltas.append(step.last_delta)
    assert step.pop_epoch_stats()["refreshes"] == 3  # steps 0, 3, 6
    assert deltas[0] is deltas[1] is deltas[2] and deltas[3] is deltas[4] is deltas[5]
    assert deltas[2] is not deltas[3] and deltas[5] is not deltas[6]
    assert not torch.equal(draws[0], draws[3])


def test_build_copies_the_warmup_model_and_logs_each_epoch():
    data = indexed_data(64)
    warm = small_model()
    before = params_of(warm)
    logged: list[tuple[int, dict]] = []
    method = _dpadapter(epochs=3, m2=16, max_steps=10)
    model = method.build(context(data, warm, lambda e, s: logged.append((e, s))))
    assert model is not warm and _equal(params_of(warm), before)
    assert not _equal(params_of(model), before)
    assert [e for e, _ in logged] == [1, 2, 3]
    assert logged[-1][1]["steps"] == 10  # max_steps cuts the third epoch short
    for _, stats in logged:
        for key in (
            "train_loss",
            "b1_loss",
            "delta_norm",
            "delta_norm_raw",
            "gamma_binding",
            "refreshes",
        ):
            assert math.isfinite(stats[key])
        assert 0.0 <= stats["gamma_binding"] <= 1.0
        assert stats["delta_norm"] <= 0.5 + 1e-6


def test_relative_step_cost():
    assert relative_step_cost(5000, 50) == 101
    assert relative_step_cost(1000, 50, refresh_every=10) == 3


@pytest.mark.slow  # in-process, too long for `make check`
def test_b1_chunk_halves_on_out_of_memory_and_gives_the_same_gradient(monkeypatch):
    """On a GPU the B1 gradient's chunk adapts to memory; the gradient does not change."""
    import dpadapter.upstream.perturbed as perturbed_mod

    data = indexed_data(64)
    warm = small_model()
    method = UPSTREAMS["dpadapter"](
        {"m1": 64, "m2": 16, "chunk_size": 64, "epochs": 1, "max_steps": 1, "lr": 0.0}
    )
    ref = method.make_step(data, 0)
    ref_grads, _ = ref._gradient(warm, *data.tensors, None)
    real = perturbed_mod.batch_gradient

    def tight_memory(model, x, y, chunk_size, index=None):
        if chunk_size > 16:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, x, y, chunk_size, index=index)

    monkeypatch.setattr(perturbed_mod, "batch_gradient", tight_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    step = method.make_step(data, 0)
    grads, _ = step._gradient(warm, *data.tensors, None)
    assert step.chunk_size == 16
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def _ema_step(data, beta=0.6, **kw):
    args = {"eta1": 1.0, "gamma": 1e6, "chunk_size": 64, **kw}
    return EMAPerturbedStep(data, sampler=B1Sampler(len(data), 64, seed=0), beta=beta, **args)


def test_ema_option_starts_exact_then_averages_earlier_clean_gradients():
    """Delta_0 is Algorithm 1's; Delta_t = eta1 * (beta avg + (1 - beta) grad L_B2(theta_{t-1}))
    from earlier steps only, so it does not depend on the update batch of its own step."""
    data = indexed_data(160)
    model = small_model()
    exact = PerturbedStep(
        data, eta1=1.0, gamma=1e6, chunk_size=64, sampler=B1Sampler(len(data), 64, seed=0)
    )
    beta = 0.6
    step = _ema_step(data, beta)
    (d_exact,) = _applied_perturbations(exact, copy.deepcopy(model), data, 1)
    opt, _ = make_sgd(model, SGDConfig(lr=0.05, momentum=0.0, weight_decay=0.0))
    x, y = data.tensors
    expected = None
    for k in range(4):
        theta = copy.deepcopy(model)
        xb, yb = x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16]
        step(model, opt, xb, yb)
        if k == 0:
            for d, e in zip(step.last_delta, d_exact, strict=True):
                torch.testing.assert_close(d, e, rtol=1e-5, atol=1e-7)
            expected = [d.clone() for d in step.last_delta]
        else:
            for d, e in zip(step.last_delta, expected, strict=True):
                torch.testing.assert_close(d, e, rtol=1e-5, atol=1e-7)
        clean = torch.autograd.grad(
            nn.functional.cross_entropy(theta(xb), yb), list(theta.parameters())
        )
        expected = [beta * e + (1 - beta) * g for e, g in zip(expected, clean, strict=True)]
    assert step.pop_epoch_stats()["refreshes"] == 4


def test_ema_option_costs_two_update_batches_per_step_after_the_first():
    data = indexed_data(160)
    model = small_model()
    step = _ema_step(data)
    opt, _ = make_sgd(model, SGDConfig(lr=0.05, momentum=0.0, weight_decay=0.0))
    rec = ForwardRecorder(model)
    x, y = data.tensors
    seen = []
    for k in range(3):
        rec.clear()
        step(model, opt, x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16])
        seen.append(sum(len(i) for i in rec.inputs))
    rec.remove()
    assert seen == [64 + 16 + 16, 32, 32]  # B1 once (then B2 clean + B2 perturbed), then 2 x B2


def test_ema_option_resumes_exactly_and_is_configurable():
    data = indexed_data(160)
    x, y = data.tensors
    runs = []
    for interrupt in (False, True):
        model = small_model()
        step = _ema_step(data)
        opt, _ = make_sgd(model, SGDConfig(lr=0.05, momentum=0.0, weight_decay=0.0))
        for k in range(5):
            if interrupt and k == 2:
                state = copy.deepcopy(step.state_dict())
                step = _ema_step(data)
                step.load_state_dict(state)
            step(model, opt, x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16])
        runs.append(params_of(model))
    assert _equal(*runs)
    assert isinstance(_dpadapter(ema_beta=0.88).make_step(data, 0), EMAPerturbedStep)
    assert type(_dpadapter().make_step(data, 0)) is PerturbedStep
    with pytest.raises(ValueError, match="refresh_every"):
        _dpadapter(ema_beta=0.5, refresh_every=2).make_step(data, 0)
