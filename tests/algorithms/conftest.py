"""Data for the algorithm tests: the tiny config's private task and public set."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class AlgoData:
    private: TensorDataset
    public: TensorDataset


@pytest.fixture
def algo_data(tiny_cfg) -> AlgoData:
    from dpadapter.data import build_splits

    _, roles = build_splits(tiny_cfg, ["syn-same", "public"])
    return AlgoData(roles["syn-same"].train, roles["public"].train)


@pytest.fixture(scope="session", autouse=True)
def _shared_calibration_cache(tmp_path_factory):
    """Identical calibrations (same target, delta, q, steps) are computed once per session."""
    import algo_harness

    algo_harness.CALIBRATION_CACHE = str(tmp_path_factory.mktemp("calib") / "sigma.json")
    yield
    algo_harness.CALIBRATION_CACHE = None


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared machine threads spin-wait."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
