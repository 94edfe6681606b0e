"""Data for the algorithm tests: the tiny config's private task and public set; one torch
thread (`torch_threads`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from torch.utils.data import TensorDataset
from torch_threads import _one_torch_thread  # noqa: F401  (tests/ is on sys.path)


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
