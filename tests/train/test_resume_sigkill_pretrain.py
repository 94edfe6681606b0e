"""A DPAdapter pre-training job killed with SIGKILL (a Slurm time limit, a node failure) and
started again continues from its last epoch and ends with the weights of an uninterrupted run.

Real processes, as the Snakemake rule runs them (`python -m dpadapter ... pretrain`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from dpadapter.settings import from_dict
from dpadapter.stages import warmup
from dpadapter.train.resume import resume_file_path

EPOCHS = 4


def _cmd(cfg_file, warm, out):
    return [
        sys.executable, "-m", "dpadapter", "--config", str(cfg_file), "pretrain",
        "--method", "dpadapter", "--warmup", str(warm), "--out", str(out),
    ]  # fmt: skip


def _env(wd):
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{wd / 'mlruns.db'}",
        "DPADAPTER_THREADS": "1",
    }


@pytest.mark.slow
def test_sigkilled_dpadapter_pretraining_resumes(tiny_raw, tmp_path, monkeypatch):
    tiny_raw["pretrain"]["methods"] = ["scratch", "standard", "dpadapter"]
    tiny_raw["pretrain"]["params"] = {
        "dpadapter": {
            "epochs": EPOCHS,
            "m1": 100,
            "m2": 50,  # 20 steps an epoch on the 1000 public images
            "gamma": 0.5,
            "lr": 0.01,
            "milestones": [2],
            "chunk_size": 100,
            "refresh_every": 3,
        }
    }
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_raw))
    cfg = from_dict(tiny_raw)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'warm.db'}")
    warmup.run(cfg, tmp_path / "warmup")
    warm = tmp_path / "warmup" / "model.pt"

    killed_wd, full_wd = tmp_path / "killed", tmp_path / "full"
    for wd in (killed_wd, full_wd):
        wd.mkdir()
    state = killed_wd / resume_file_path(cfg.results_dir, "pretrain", "dpadapter")
    out = killed_wd / "pre"
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    full = subprocess.Popen(_cmd(cfg_file, warm, full_wd / "pre"), cwd=full_wd,
                            env=_env(full_wd), **popen)  # fmt: skip
    victim = subprocess.Popen(_cmd(cfg_file, warm, out), cwd=killed_wd,
                              env=_env(killed_wd), **popen)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not state.exists() and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert victim.poll() is None, f"finished before it could be killed:\n{victim.stdout.read()}"
        assert state.exists(), "no epoch state file within 300 s"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (out / "metrics.json").exists()
    killed_at = torch.load(state, map_location="cpu", weights_only=False)["epoch"]
    assert 1 <= killed_at < EPOCHS

    again = subprocess.run(
        _cmd(cfg_file, warm, out), cwd=killed_wd, env=_env(killed_wd), timeout=600, **popen
    )
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"[dpadapter] resumed at step {20 * killed_at}/{20 * EPOCHS}" in again.stdout
    full_out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, full_out[-3000:]

    resumed = json.loads((out / "metrics.json").read_text())
    reference = json.loads((full_wd / "pre" / "metrics.json").read_text())
    assert resumed["resumed_from"]["epoch"] == killed_at and "resumed_from" not in reference
    w_res = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    w_ref = torch.load(full_wd / "pre" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(w_res[k], w_ref[k]) for k in w_ref)
    assert resumed["public_test_accuracy"] == reference["public_test_accuracy"]
    assert not state.exists()

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{killed_wd / 'mlruns.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    runs = [r for r in runs if "stage" in r.data.tags]  # the job's, not its stage's group run
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
