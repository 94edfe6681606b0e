"""Every check of bench/gpu/gpu_smoke.py can fail: each fails on the CPU with its bug planted.

The GPU smoke passes only if its checks hold on CUDA; a check that cannot fail would let the
first GPU run pass whatever the CUDA path does. Runs are small (1000 examples of 16x16, a
width-8 CNN) so the whole file takes seconds per run.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from bench_scripts import import_bench

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smoke():
    return import_bench("gpu_smoke")


@pytest.fixture
def cfg(smoke, tmp_path):
    c = smoke.smoke_config("cpu", "ew")
    return dataclasses.replace(
        c,
        results_dir=str(tmp_path),
        model=dataclasses.replace(c.model, width=8),
    )


def _check(smoke, cfg, name="dpsgd", repeat=False):
    return smoke.check_algorithm(name, cfg, CPU, repeat=repeat, n=1000, side=16)


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_a_correct_run_passes_every_check(smoke, cfg):
    r = _check(smoke, cfg, repeat=True)
    assert r["failures"] == {}
    assert r["accuracy"] >= smoke.MIN_ACCURACY and r["noise_draws"] > 10_000
    assert abs(r["noise_std_over_declared"] - 1) < smoke.NOISE_STD_TOLERANCE


def test_noise_check_sees_too_little_noise(smoke, cfg, monkeypatch):
    # the draw the DP optimizers' noise phase makes (per_sample.optimizers.FusedRelease)
    import dpadapter.per_sample.optimizers as opt_mod

    real = opt_mod.gaussian_noise
    monkeypatch.setattr(opt_mod, "gaussian_noise", lambda std, *a, **k: real(std / 2, *a, **k))
    assert "noise" in _check(smoke, cfg)["failures"]


def test_noise_check_sees_a_ledger_that_under_records(smoke, cfg, monkeypatch):
    from dpadapter.algorithms import DPAlgorithm

    real = DPAlgorithm.accounted_noise_multiplier
    monkeypatch.setattr(
        DPAlgorithm, "accounted_noise_multiplier", lambda self, opt: 1.5 * real(self, opt)
    )
    assert "ledger records sigma" in _check(smoke, cfg)["failures"]["noise"]


def test_epsilon_check_sees_a_missing_release(smoke, cfg, monkeypatch):
    from dpadapter.privacy import PrivacyLedger

    real = PrivacyLedger.record
    count = itertools.count()

    def drop_every_tenth(self, *args, **kwargs):
        if next(count) % 10 != 9:
            real(self, *args, **kwargs)

    monkeypatch.setattr(PrivacyLedger, "record", drop_every_tenth)
    assert "planned" in _check(smoke, cfg)["failures"]["epsilon"]


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_accuracy_check_sees_a_run_that_learns_nothing(smoke, cfg):
    frozen = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, lr=1e-9))
    r = _check(smoke, frozen)
    assert "accuracy" in r["failures"]
    # every further noise seed was tried before the check failed
    assert len(r["accuracy_other_seeds"]) == len(smoke.ACCURACY_SEEDS) - 1


def test_accuracy_check_fails_only_when_every_seed_is_below_the_floor(smoke):
    low, high = smoke.MIN_ACCURACY - 0.01, smoke.MIN_ACCURACY + 0.01
    assert smoke.check_accuracy([low, low, low]) is not None
    assert smoke.check_accuracy(low) is not None
    assert smoke.check_accuracy([low, high]) is None
    assert smoke.check_accuracy([float("nan")] * 3) is not None


def test_finite_check_sees_nan_weights(smoke):
    model = torch.nn.Linear(3, 2)
    assert smoke.check_finite(model) is None
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert "weight" in smoke.check_finite(model)


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_repeat_check_sees_an_unseeded_noise_generator(smoke, cfg, monkeypatch):
    from dpadapter.ground import device as devices

    fresh = itertools.count(1)
    real = devices.generator
    monkeypatch.setattr(devices, "generator", lambda dev, seed: real(dev, seed + next(fresh)))
    assert "differ" in _check(smoke, cfg, repeat=True)["failures"]["repeat"]


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_shape_check_sees_unpadded_batches(smoke, cfg, monkeypatch):
    from dpadapter.train import batching

    padded = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, pad_batches=True))
    r = _check(smoke, padded)
    assert r["failures"] == {} and len(r["physical_shapes"]) == 1
    monkeypatch.setattr(batching, "pad_batch", lambda x, y, size, optimizer=None: (x, y))
    assert "shapes" in _check(smoke, padded)["failures"]


def test_device_check_sees_parameters_or_batches_elsewhere(smoke):
    model = torch.nn.Linear(3, 2)
    assert smoke.check_device(model, {"cpu"}, CPU) is None
    assert "want cuda" in smoke.check_device(model, {"cpu"}, torch.device("cuda"))
    assert smoke.check_device(model, {"cpu", "cuda"}, CPU) is not None
