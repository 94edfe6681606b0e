"""The calibration memo (`privacy.memo`): a repeat of every input hits, in this process and in
another job's, and a change of any single input misses (a key that left one out would hand a
run another run's noise); epsilon is never memoised."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dpadapter.algorithms import ALGORITHMS, DPRunSpec
from dpadapter.algorithms import adpalloc as adp
from dpadapter.federated import mechanisms as fed
from dpadapter.privacy import PrivacyLedger, Segment, accounting, calibration, memo
from dpadapter.privacy.accounting import epsilon_from_history
from dpadapter.privacy.calibration import calibrate_sigma


@pytest.fixture
def counted(monkeypatch):
    """Stubbed accountants whose calls are counted (each returns a value unique to its inputs)."""
    calls = []

    def sigma(*args, **kw):
        calls.append(("sigma", args))
        return 1.0 + len(calls)

    def eps(history, delta, accountant):
        calls.append(("eps", tuple(history), delta, accountant))
        return 0.5 + len(calls)

    monkeypatch.setattr(calibration, "_calibrate", sigma)
    monkeypatch.setattr(accounting, "_epsilon", eps)
    memo.clear_memory()
    yield calls
    memo.clear_memory()


SIGMA_BASE = dict(target_epsilon=2.0, delta=1e-5, sample_rate=0.1, steps=30, accountant="prv")
SIGMA_CHANGES = [
    ("target_epsilon", 2.0000001),
    ("delta", 1.1e-5),
    ("sample_rate", 0.1000001),
    ("steps", 31),
    ("accountant", "rdp"),
]


def test_sigma_repeats_hit_and_every_changed_input_misses(tmp_path, counted, monkeypatch):
    cache = tmp_path / "sigma.json"
    first = calibrate_sigma(**SIGMA_BASE, cache=cache)
    assert calibrate_sigma(**SIGMA_BASE, cache=cache) == first and len(counted) == 1
    memo.clear_memory()  # another job: the file answers
    assert calibrate_sigma(**SIGMA_BASE, cache=cache) == first and len(counted) == 1
    for i, (name, value) in enumerate(SIGMA_CHANGES, start=2):
        got = calibrate_sigma(**{**SIGMA_BASE, name: value}, cache=cache)
        assert len(counted) == i and got != first, name
    # the accountant's implementation (Opacus' version) and PRV's error bound are inputs too
    monkeypatch.setattr(calibration, "accountant_version", lambda: "0.0-other")
    calibrate_sigma(**SIGMA_BASE, cache=cache)
    assert len(counted) == len(SIGMA_CHANGES) + 2
    monkeypatch.setattr(calibration, "EPS_ERROR", calibration.EPS_ERROR / 2)
    calibrate_sigma(**SIGMA_BASE, cache=cache)
    assert len(counted) == len(SIGMA_CHANGES) + 3
    assert len(json.loads(cache.read_text())) == len(SIGMA_CHANGES) + 3


def test_epsilon_is_never_memoised(counted):
    """Every epsilon is the accountant's, each time it is asked (the memo plans sigma only)."""
    a = PrivacyLedger(1e-5, "prv")
    b = PrivacyLedger(1e-5, "prv")  # another seed of the same grid cell
    for _ in range(3):
        a.record(1.1, 0.1, 10)
        b.record(1.1, 0.1, 10)
        a.epsilon(), b.epsilon()
    assert len(counted) == 6
    history = [Segment(1.1, 0.1, 10)]
    epsilon_from_history(history, 1e-5), epsilon_from_history(history, 1e-5)
    assert len(counted) == 8


def test_real_values_round_trip_exactly(tmp_path):
    """What the file returns is the calibration's float, bit for bit."""
    memo.clear_memory()
    cache = tmp_path / "sigma.json"
    want = calibrate_sigma(2.0, 1e-5, 0.05, 40, "rdp")
    assert calibrate_sigma(2.0, 1e-5, 0.05, 40, "rdp", cache) == want
    memo.clear_memory()
    assert calibrate_sigma(2.0, 1e-5, 0.05, 40, "rdp", cache) == want
    memo.clear_memory()


def test_adpalloc_schedule_key_names_every_input(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(adp, "calibrate_decay", lambda *a: calls.append(a) or 3.0 + len(calls))
    monkeypatch.setattr(calibration, "_calibrate", lambda *a, **k: 2.0)
    memo.clear_memory()
    cache = str(tmp_path / "sigma.json")
    base = DPRunSpec(
        target_epsilon=4.0,
        delta=1e-5,
        sample_rate=0.1,
        steps_per_epoch=10,
        epochs=2,
        expected_batch_size=12,
        max_grad_norm=1.0,
        accountant="rdp",
        calibration_cache=cache,
    )

    def sigma(spec, decay=0.01):
        algo = ALGORITHMS["adpalloc"].__new__(ALGORITHMS["adpalloc"])
        algo.spec, algo.params = spec, {"decay": decay}
        return algo.calibrate()

    first = sigma(base)
    assert sigma(base) == first and len(calls) == 1
    changes = [
        {"target_epsilon": 4.5},
        {"delta": 2e-5},
        {"sample_rate": 0.2},
        {"steps_per_epoch": 11},
        {"epochs": 3},
        {"accountant": "prv"},
    ]
    for i, kw in enumerate(changes, start=2):
        assert sigma(dataclasses.replace(base, **kw)) != first and len(calls) == i, kw
    sigma(base, decay=0.02)
    assert len(calls) == len(changes) + 2
    memo.clear_memory()


def test_federated_joint_sigma_key_names_the_prior(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(fed, "calibrate_sigma", lambda *a: 1.0)
    monkeypatch.setattr(fed, "_joint_sigma", lambda *a: calls.append(a) or 1.5 + len(calls))
    memo.clear_memory()
    cache = tmp_path / "sigma.json"
    args = (2.0, 1e-5, 0.2, 20, "prv")
    first = fed.gaussian_sigma(*args, [Segment(5.0, 1.0, 3)], cache)
    assert fed.gaussian_sigma(*args, [Segment(5.0, 1.0, 3)], cache) == first
    assert fed.gaussian_sigma(*args, [Segment(5.0, 1.0, 4)], cache) != first
    assert fed.gaussian_sigma(*args, [Segment(5.1, 1.0, 3)], cache) != first
    assert len(calls) == 3
    memo.clear_memory()
    assert not math.isnan(first)
