"""A fine-tuning job killed with SIGKILL (a node failure, a Slurm time limit) and started again
continues from its last epoch state and ends exactly where an uninterrupted run ends.

Real processes (`python -m dpadapter ... finetune`, as the Snakemake rule runs it): one is
killed as soon as its first epoch state file appears, then the same command is run again.
"""

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
from dpadapter.stages import finetune, pretrain

EPOCHS = 4
WILDCARDS = {"upstream": "scratch", "task": "syn-shift", "algo": "dpsgd", "eps": "2", "seed": "0"}


def _cmd(cfg_file, ckpt, out):
    return [
        sys.executable, "-m", "dpadapter", "--config", str(cfg_file), "finetune",
        "--upstream", "scratch", "--task", "syn-shift", "--algo", "dpsgd", "--eps", "2",
        "--seed", "0", "--ckpt", str(ckpt), "--out", str(out),
    ]  # fmt: skip


def _env(workdir):
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlruns.db'}",
        "DPADAPTER_THREADS": "1",
    }


@pytest.mark.slow
def test_sigkilled_finetune_resumes_to_the_uninterrupted_result(tiny_raw, tmp_path, monkeypatch):
    raw = tiny_raw
    raw["finetune"]["epochs"] = EPOCHS
    raw["tasks"]["syn-shift"]["n_train"] = 1000  # 20 steps an epoch: time to kill mid-run
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    cfg = from_dict(raw)

    # The upstream checkpoint both runs start from (absolute path: it is part of the identity
    # a resume state is checked against).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'pre.db'}")
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    ckpt = tmp_path / "pre" / "model.pt"

    killed_wd, full_wd = tmp_path / "killed", tmp_path / "full"
    for wd in (killed_wd, full_wd):
        wd.mkdir()
    state = killed_wd / finetune.resume_path(cfg, WILDCARDS)
    out = killed_wd / "ft"

    # The uninterrupted reference runs alongside the one we kill (2 cores, 1 thread each).
    full = subprocess.Popen(
        _cmd(cfg_file, ckpt, full_wd / "ft"),
        cwd=full_wd,
        env=_env(full_wd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    victim = subprocess.Popen(
        _cmd(cfg_file, ckpt, out),
        cwd=killed_wd,
        env=_env(killed_wd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
    assert not (out / "metrics.json").exists(), "a killed job leaves no result"
    killed_at = torch.load(state, map_location="cpu", weights_only=False)["epoch"]
    assert 1 <= killed_at < EPOCHS

    # Started again with the same command, it picks up the state and finishes the job.
    again = subprocess.run(
        _cmd(cfg_file, ckpt, out),
        cwd=killed_wd,
        env=_env(killed_wd),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    full_out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, full_out[-3000:]

    resumed = json.loads((out / "metrics.json").read_text())
    reference = json.loads((full_wd / "ft" / "metrics.json").read_text())
    assert resumed["resumed_from_epoch"] == killed_at
    assert "resumed_from_epoch" not in reference
    # Same privacy accounting: every step and release, hence the same final epsilon.
    assert resumed["privacy"]["steps"] == reference["privacy"]["steps"] == EPOCHS * 20
    assert resumed["privacy"]["history"] == reference["privacy"]["history"]
    assert resumed["privacy"]["epsilon"] == pytest.approx(
        reference["privacy"]["epsilon"], rel=1e-12
    )
    assert [e["epoch"] for e in resumed["epochs"]] == list(range(1, EPOCHS + 1))
    # Same model, hence the same accuracy.
    w_res = torch.load(out / "model.pt", weights_only=False)["state_dict"]
    w_ref = torch.load(full_wd / "ft" / "model.pt", weights_only=False)["state_dict"]
    assert all(torch.allclose(w_res[k], w_ref[k], atol=1e-6) for k in w_ref)
    assert resumed["test_accuracy"] == reference["test_accuracy"]
    assert not state.exists(), "the resume state is removed once the job succeeds"

    # The resumed process continued the killed job's MLflow run instead of opening another.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{killed_wd / 'mlruns.db'}")
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id])
    runs = [r for r in runs if "stage" in r.data.tags]  # the job's, not its stage's group run
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "epsilon_spent")}
    assert steps == set(range(1, EPOCHS + 1))
