"""A resumed algorithm keeps its state next to the parameters (issue 23, item 1).

The stage reads resume states onto the CPU; on a GPU node a CPU tensor kept by the algorithm
(DP-SAT's previous gradient, GEP's stored anchor bases, DP-SAM's ascent in progress) would meet
CUDA weights at the next step. On the CPU the same slip shows as a dtype: a state written by a
float32 run and restored into a float64 model must come back float64, on the device asked for.
"""

from __future__ import annotations

import copy
import dataclasses

import algo_harness as H
import pytest
import torch
from torch.utils.data import TensorDataset

from dpadapter.algorithms import ALGORITHMS

NAMES = sorted(ALGORITHMS)
# anchor_every > 1: GEP's bases are stored in the state instead of being refit at once
PARAMS = {"gep": {"anchor_every": 3}}
# algorithms whose mid-batch state holds tensors (the others keep only numbers)
WITH_TENSORS = {"dpsat", "dpsat-momentum", "gep", "dpsam"}


def tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def _double(ds: TensorDataset) -> TensorDataset:
    x, y = ds.tensors
    return TensorDataset(x.double(), y)


def _float32_state(name: str, algo_data) -> tuple[dict, H.Run]:
    """State of a float32 run in the middle of its third logical batch."""
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12, params=PARAMS.get(name, {}))
    run = H.build(name, s, public=algo_data.public, sigma=0.7, lr=0.3, momentum=0.9, audit=False)
    x, y = algo_data.private.tensors
    for t in range(2):
        H.logical_step(run, x[12 * t : 12 * t + 12], y[12 * t : 12 * t + 12], physical=5)
    run.opt.signal_skip_step(do_skip=True)  # first physical batch of a logical batch of two
    run.algo.train_step(run.gsm, x[24:29], y[24:29], H.LOSS)
    state = copy.deepcopy(run.algo.state_dict())
    if name in WITH_TENSORS:
        assert tensors(state), f"{name}: the state holds no tensor, the test checks nothing"
    assert all(t.dtype != torch.float64 for t in tensors(state))
    return state, run


def _float64_run(name: str, algo_data, run: H.Run) -> H.Run:
    public = _double(algo_data.public)
    return H.build(
        name,
        run.algo.spec,
        public=public,
        sigma=0.7,
        lr=0.3,
        momentum=0.9,
        audit=False,
        dtype=torch.float64,
        model=H.tiny_model(seed=7),
    )


@pytest.mark.parametrize("name", NAMES)
def test_restored_state_takes_the_parameters_device_and_dtype(name, algo_data):
    state, run = _float32_state(name, algo_data)
    resumed = _float64_run(name, algo_data, run)
    resumed.model.load_state_dict(run.model.state_dict())
    p = next(resumed.model.parameters())
    resumed.algo.load_state_dict(state, device=p.device, dtype=p.dtype)
    restored = tensors(resumed.algo.state_dict())
    assert len(restored) == len(tensors(state))
    for t in restored:
        assert t.device == p.device
        if t.is_floating_point():
            assert t.dtype == torch.float64, t.dtype
    # the resumed run finishes the logical batch in float64 and releases once
    x, y = algo_data.private.tensors
    before = resumed.ledger.steps
    resumed.opt.signal_skip_step(do_skip=False)
    resumed.algo.train_step(resumed.gsm, x[29:36].double(), y[29:36], H.LOSS)
    assert resumed.ledger.steps == before + 1
    for q in resumed.model.parameters():
        assert q.dtype == torch.float64 and torch.isfinite(q).all()


@pytest.mark.parametrize("name", sorted(WITH_TENSORS))
def test_restored_state_goes_to_the_device_asked_for(name, algo_data):
    """The meta device stands in for CUDA: every tensor must land there, not stay on the CPU."""
    state, run = _float32_state(name, algo_data)
    resumed = _float64_run(name, algo_data, run)
    meta = torch.device("meta")
    resumed.algo.load_state_dict(state, device=meta, dtype=torch.float64)
    restored = tensors(resumed.algo.state_dict())
    assert restored
    assert all(t.device == meta for t in restored)


class _Saves:
    """A resume store in memory: `state` to start from, `save` called at each epoch's end."""

    def __init__(self, state, save):
        self.state, self.save = state, save


@pytest.mark.slow  # in-process, too long for `make check`
def test_stage_resume_passes_the_parameters_device_and_dtype(tiny_cfg, algo_data, monkeypatch):
    """dp_fit hands the model's device and dtype to the algorithm's load_state_dict."""
    from dpadapter.train import dp_fit as fit
    from dpadapter.train.dp_spec import run_spec

    name = "dpsat"
    train = algo_data.private
    spec = dataclasses.replace(
        run_spec(tiny_cfg, name, 4.0, len(train)),
        epochs=2,
        calibration_cache=H.CALIBRATION_CACHE,
    )
    saved: list[dict] = []
    settings = fit.FitSettings.from_config(tiny_cfg)
    fit.dp_fit(H.tiny_model(), train, name, spec, settings, 0, resume=_Saves(None, saved.append))
    assert len(saved) == 1 and tensors(saved[0]["algorithm"])
    seen: list[torch.Tensor] = []

    class Spy(ALGORITHMS[name]):
        def load_state_dict(self, state, *args, **kwargs):
            super().load_state_dict(state, *args, **kwargs)
            seen.extend(tensors(self.state_dict()))

    monkeypatch.setitem(fit.ALGORITHMS, name, Spy)
    model = H.tiny_model().double()
    fit.dp_fit(model, _double(train), name, spec, settings, 0, resume=_Saves(saved[0], print))
    assert seen
    assert all(t.dtype == torch.float64 for t in seen)
