"""A resumed perturbation step keeps Delta (and DPAdapter-EMA's average) next to the parameters.

Resume states are read onto the CPU; on a GPU node a CPU Delta would be added to CUDA weights.
On the CPU the slip shows as a dtype: a float32 state restored into a float64 model must come
back float64 (issue 23, item 1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset
from upstream.upstream_helpers import indexed_data, small_model

from dpadapter.settings import SGDConfig
from dpadapter.train.loops import sgd_train
from dpadapter.train.resume import ResumeFile
from dpadapter.upstream import UPSTREAMS

# every registered method whose training step keeps state of its own
WITH_STEP = sorted(n for n, cls in UPSTREAMS.items() if hasattr(cls, "make_step"))
PARAMS = {
    "dpadapter": {"m1": 40, "m2": 16, "refresh_every": 4},
    "dpadapter-ema": {"m1": 40, "m2": 8},
}
CFG = SGDConfig(
    epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=0.0, milestones=(), max_steps=None
)


def _method(name: str):
    return UPSTREAMS[name]({"gamma": 0.5, "eta1": 1.0, "chunk_size": 16, **PARAMS.get(name, {})})


def _tensors(state: dict) -> list[torch.Tensor]:
    out = [*(state.get("last_delta") or []), *(state.get("average") or [])]
    return [t for t in out if t.is_floating_point()]


def _double(data: TensorDataset) -> TensorDataset:
    x, y = data.tensors
    return TensorDataset(x.double(), y)


def test_every_method_with_a_step_is_covered():
    assert {"sam", "dpadapter", "dpadapter-ema"} <= set(WITH_STEP)


@pytest.mark.parametrize("name", WITH_STEP)
def test_step_state_takes_the_parameters_device_and_dtype(name):
    data = indexed_data(64)
    step = _method(name).make_step(data, 0)
    model = small_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data.tensors
    for i in range(3):
        step(model, opt, x[16 * i : 16 * i + 16], y[16 * i : 16 * i + 16])
    state = step.state_dict()
    assert _tensors(state) and all(t.dtype == torch.float32 for t in _tensors(state))

    resumed = _method(name).make_step(_double(data), 0)
    for device in (torch.device("cpu"), torch.device("meta")):  # meta stands in for CUDA
        resumed.load_state_dict(state, device=device, dtype=torch.float64)
        placed = [*resumed.last_delta, *(getattr(resumed, "average", None) or [])]
        assert len(placed) == len(_tensors(state))
        for t in placed:
            assert t.device == device and t.dtype == torch.float64, (t.device, t.dtype)


def test_sgd_train_resume_passes_the_parameters_dtype(tmp_path, monkeypatch):
    """sgd_train restores a step's state with the model's device and dtype."""
    name = "dpadapter"
    data = indexed_data(64)
    resume = ResumeFile(tmp_path / "state.pt", "id")
    cfg = dataclasses.replace(CFG, epochs=2)
    sgd_train(
        small_model(seed=1),
        data,
        cfg,
        seed=3,
        step=_method(name).make_step(data, 0),
        resume=resume,
        save_every_s=1e9,
    )
    assert ResumeFile(tmp_path / "state.pt", "id").state is not None

    step = _method(name).make_step(_double(data), 0)
    seen: list[torch.Tensor] = []
    real = step.load_state_dict

    def spy(state, *args, **kwargs):
        real(state, *args, **kwargs)
        seen.extend(step.last_delta or [])

    monkeypatch.setattr(step, "load_state_dict", spy)
    sgd_train(
        small_model(seed=1).double(),
        _double(data),
        cfg,
        seed=3,
        step=step,
        resume=ResumeFile(tmp_path / "state.pt", "id"),
    )
    assert seen and all(t.dtype == torch.float64 for t in seen)
