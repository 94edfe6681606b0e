"""Device selection: one switch (config `device`, env DPADAPTER_DEVICE), honoured everywhere."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dpadapter.ground import device as devices
from dpadapter.stages import finetune, pretrain, warmup
from dpadapter.train.resume import ResumeFile

CUDA = torch.cuda.is_available()


def test_config_choice_and_environment_override(monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.resolve("auto").type == ("cuda" if CUDA else "cpu")
    monkeypatch.setenv(devices.ENV_VAR, "cpu")
    assert devices.resolve("cuda") == torch.device("cpu")  # one job moved off the GPU
    monkeypatch.setenv(devices.ENV_VAR, "tpu")
    with pytest.raises(devices.DeviceError, match="tpu"):
        devices.resolve("auto")


@pytest.mark.skipif(CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda_fails_before_any_work(monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    with pytest.raises(devices.DeviceError, match="no CUDA device"):
        devices.resolve("cuda")


class _CudaTouched(AssertionError):
    pass


def _forbid_cuda(monkeypatch):
    """Make every entry into CUDA raise: availability checks, lazy init, device queries."""
    calls = []

    def boom(*a, **k):
        calls.append(a)
        raise _CudaTouched("CUDA was touched by a device: cpu job")

    for name in ("is_available", "_lazy_init", "device_count", "current_device", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, boom)
    return calls


def _tiny(tiny_cfg, device):
    return dataclasses.replace(tiny_cfg, device=device)


@pytest.mark.slow  # in-process, too long for `make check`
def test_device_cpu_jobs_never_touch_cuda(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    cfg = _tiny(tiny_cfg, "cpu")
    _forbid_cuda(monkeypatch)
    warmup.run(cfg, tmp_path / "warm")
    pretrain.run(cfg, "standard", tmp_path / "pre", tmp_path / "warm" / "model.pt")
    finetune.run(
        cfg,
        "standard",
        "syn-shift",
        "dpsgd",
        2.0,
        0,
        tmp_path / "pre" / "model.pt",
        tmp_path / "ft",
    )
    m = json.loads((tmp_path / "ft" / "metrics.json").read_text())
    assert m["device"]["device"] == "cpu" and m["device"]["torch"] == torch.__version__
    assert m["device"]["peak_memory_mib"] is None  # a GPU figure only where a GPU ran


def test_the_guard_sees_an_auto_job_asking_for_cuda(tiny_cfg, tmp_path, monkeypatch):
    """The test above could not fail if nothing ever asked CUDA; with `auto`, something does."""
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    calls = _forbid_cuda(monkeypatch)
    with pytest.raises(_CudaTouched):
        warmup.run(_tiny(tiny_cfg, "auto"), tmp_path / "warm")
    assert calls


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (CI has none; bench/gpu/gpu_smoke.sh)")
@pytest.mark.parametrize("algo", ["dpsgd", "dpsat", "dpsam", "gep", "adpalloc", "adpclip"])
def test_dp_job_on_cuda_keeps_the_ledger_and_resumes(algo, tiny_cfg, tmp_path, monkeypatch):
    from dpadapter.privacy import Segment, epsilon_from_history

    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    cfg = _tiny(tiny_cfg, "cuda")
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    ckpt = tmp_path / "pre" / "model.pt"
    full = finetune.run(cfg, "scratch", "syn-shift", algo, 2.0, 0, ckpt, tmp_path / "full")
    assert full["device"]["device"].startswith("cuda")
    assert full["device"]["peak_memory_mib"] > 0
    p = full["privacy"]
    hist = [Segment(**s) for s in p["history"]]
    assert p["epsilon"] == pytest.approx(epsilon_from_history(hist, p["delta"], p["accountant"]))

    # interrupted after epoch 1, then resumed: same weights and ledger as the full run
    original = ResumeFile.save

    def save_then_stop(self, obj):
        original(self, obj)
        assert "cuda" in obj["torch_rng"]  # the CUDA RNG state is part of the resume state
        raise KeyboardInterrupt

    monkeypatch.setattr(ResumeFile, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        finetune.run(cfg, "scratch", "syn-shift", algo, 2.0, 0, ckpt, tmp_path / "res")
    monkeypatch.setattr(ResumeFile, "save", original)
    resumed = finetune.run(cfg, "scratch", "syn-shift", algo, 2.0, 0, ckpt, tmp_path / "res")
    assert resumed["privacy"]["history"] == p["history"]
    wa = torch.load(tmp_path / "full" / "model.pt")["state_dict"]
    wb = torch.load(tmp_path / "res" / "model.pt")["state_dict"]
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
