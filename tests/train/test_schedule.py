"""K as update iterations (Algorithm 1) or as epochs (Section 5.1): both readings run."""

import pytest
import torch
from torch.utils.data import TensorDataset

from dpadapter.settings import SGDConfig
from dpadapter.train.loops import sgd_train


def _recording_step(lrs):
    def step(model, opt, x, y):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return 0.0

    return step


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def test_steps_unit_runs_exactly_k_updates_with_step_milestones():
    lrs: list[float] = []
    cfg = SGDConfig(
        epochs=1, batch_size=8, lr=1.0, milestones=(5, 9), max_steps=12, schedule_unit="steps"
    )
    stats = sgd_train(torch.nn.Linear(3, 2), _data(), cfg, seed=0, step=_recording_step(lrs))
    assert stats["steps"] == 12 == len(lrs)  # 5 batches per pass: 3 passes, the last cut at K
    assert lrs == pytest.approx([1.0] * 5 + [0.1] * 4 + [0.01] * 3)


def test_epochs_unit_steps_the_schedule_per_epoch():
    lrs: list[float] = []
    cfg = SGDConfig(epochs=3, batch_size=8, lr=1.0, milestones=(2,))
    sgd_train(torch.nn.Linear(3, 2), _data(), cfg, seed=0, step=_recording_step(lrs))
    assert lrs == pytest.approx([1.0] * 10 + [0.1] * 5)
